"""Opacus's ``opacus.grad_sample.rms_norm``: dptrain's per-sample gradient rule of the layer."""

from dptrain.grad_sample.norms import rms_norm_grad_sample as compute_rms_norm_grad_sample

__all__ = ["compute_rms_norm_grad_sample"]
