"""Grad sampler for ``nn.Linear`` (any number of dimensions between batch and features).

With ``A = [B, T, in]`` the inputs and ``G = [B, T, out]`` the backprops (T = product of the middle
dimensions, 1 for 2-D inputs), sample b's weight gradient is ``G_b^T A_b`` ``[out, in]`` (one batched
matmul) and its bias gradient ``sum_t G_b[t]`` ``[out]``.
"""

from __future__ import annotations

from torch import Tensor, nn

from dptrain.grad_sample.registry import register_grad_sampler


def as_sequence(t: Tensor) -> Tensor:
    """View ``[B, *, f]`` as ``[B, T, f]`` (T = product of the middle dims; 1 for ``[B, f]``)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


@register_grad_sampler(nn.Linear)
def linear_grad_sample(layer: nn.Linear, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of a Linear layer.

    Args:
        activations: ``[x]`` with x ``[B, *, in_features]``.
        backprops: ``[B, *, out_features]``.

    Returns:
        weight: ``[B, out_features, in_features]``; bias: ``[B, out_features]``.
    """
    a, g = as_sequence(activations[0]), as_sequence(backprops)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = g.transpose(1, 2) @ a.to(g.dtype)
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = g.sum(dim=1)
    return grads
