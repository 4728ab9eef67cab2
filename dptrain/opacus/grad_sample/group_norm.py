"""Opacus's ``opacus.grad_sample.group_norm``: dptrain's per-sample gradient rule of the layer."""

from dptrain.grad_sample.norms import group_norm_grad_sample as compute_group_norm_grad_sample

__all__ = ["compute_group_norm_grad_sample"]
