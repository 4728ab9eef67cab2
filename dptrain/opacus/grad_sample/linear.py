"""Opacus's ``opacus.grad_sample.linear``: dptrain's per-sample gradient and norm rules of
nn.Linear, with Opacus's signature f(layer, activations, backprops) -> {parameter: tensor}."""

from dptrain.grad_sample.ghost_linear import linear_norms as compute_linear_norm_sample
from dptrain.grad_sample.linear import linear_grad_sample as compute_linear_grad_sample

__all__ = ["compute_linear_grad_sample", "compute_linear_norm_sample"]
