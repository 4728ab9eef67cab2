"""Opacus's ``opacus.grad_sample.instance_norm``: dptrain's per-sample gradient rule of the layer."""

from dptrain.grad_sample.norms import instance_norm_grad_sample as compute_instance_norm_grad_sample

__all__ = ["compute_instance_norm_grad_sample"]
