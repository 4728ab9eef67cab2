"""Opacus's ``opacus.grad_sample.layer_norm``: dptrain's per-sample gradient rule of the layer."""

from dptrain.grad_sample.norms import layer_norm_grad_sample as compute_layer_norm_grad_sample

__all__ = ["compute_layer_norm_grad_sample"]
