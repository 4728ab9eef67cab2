"""Ghost rules for ``nn.Linear`` (and subclasses such as the DP layers' ``RNNLinear``).

Inputs ``[B, *, d]`` and output gradients ``[B, *, p]`` are viewed as ``[B, T, d]`` / ``[B, T, p]``
(T = 1 for plain vectors, the sequence length for ``[B, T, d]``, the product of the middle dims in
general). Several uses of one Linear in a backward (a recurrent cell over T steps, tied weights)
fold into one call by concatenating their positions: the per-sample gradient of the sum of uses is
``sum_uses G_u^T A_u = [G_1; G_2; ...]^T [A_1; A_2; ...]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptrain.grad_sample.ghost_math import (
    as_sequence,
    bias_sq_norms,
    chunked_outer_gram_pair,
    ghost_cost_ratio,
    ghost_sq_norms,
    gram_bias_sq_norm_bounds,
    gram_dtype,
    inflated,
    norm_dtype,
    operand_gram,
    outer_gram_pair,
    prefer_ghost,
    rounded_up,
    tightened_gram_bounds,
    weighted_bias_sum,
    weighted_outer_sum,
)
from dptrain.grad_sample.ghost_registry import (
    Use,
    Weights,
    register_clipped_sum,
    register_ghost_cost,
    register_use_merger,
)
from dptrain.grad_sample.registry import register_norm_sampler


def _sequences(activations: list[Tensor], backprops: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's input and output gradient as ``[B, T, d]`` and ``[B, T, p]``."""
    return as_sequence(activations[0]), as_sequence(backprops)


@register_norm_sampler(nn.Linear)
def linear_norms(layer: nn.Linear, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample squared norms ``{weight: [B], bias: [B]}`` by the ghost identity (upper bounds,
    see :mod:`~dptrain.grad_sample.ghost_math`); over several positions, one Gram of G serves both."""
    a, g = _sequences(activations, backprops)
    weight = layer.weight.requires_grad
    bias = layer.bias is not None and layer.bias.requires_grad
    if a.shape[1] == 1:
        return vector_norms(layer, a, g)
    if not (weight and bias):
        norms = {layer.weight: ghost_sq_norms(a, g)} if weight else {}
        if bias:
            norms[layer.bias] = bias_sq_norms(g)
        return norms
    return dict(zip((layer.weight, layer.bias), outer_and_bias_norms(a, g)))


def vector_norms(layer: nn.Linear, a: Tensor, g: Tensor) -> dict[nn.Parameter, Tensor]:
    """``{weight: ||a||^2 ||g||^2, bias: ||g||^2}`` for one position (``[B, 1, d]``, ``[B, 1, p]``):
    float64 sums of squares (exact squares of float32 inputs), one ``||g||^2`` for both, each
    inflated by its roundings (:func:`~dptrain.grad_sample.ghost_math.inflated`): upper bounds."""
    out = norm_dtype(g)
    g2 = g.double().square().sum(dim=(1, 2))
    norms = {}
    if layer.weight.requires_grad:
        a2 = a.double().square().sum(dim=(1, 2))
        norms[layer.weight] = rounded_up(inflated(a2 * g2, a.shape[2] + g.shape[2] + 1), out)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = rounded_up(inflated(g2, g.shape[2]), out)
    return norms


def outer_and_bias_norms(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Upper bounds of ``||G_i^T A_i||^2`` and ``||sum_t G_i[t]||^2`` (``[B]``, norm dtype) from
    ``[B, T, d]`` and ``[B, T, p]``, computing ``G G^T`` once."""
    dtype = gram_dtype(g)
    gram_g = operand_gram(g.to(dtype))
    grams, chunked = outer_gram_pair(a, g, gram_g), chunked_outer_gram_pair(a, g)
    weight = tightened_gram_bounds(grams, dtype, a.shape[0], chunked)
    bias = gram_bias_sq_norm_bounds(*gram_g, g)
    out = norm_dtype(g)
    return rounded_up(weight, out), rounded_up(bias, out)


@register_clipped_sum(nn.Linear)
def linear_clipped_sum(
    layer: nn.Linear, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``sum_i w_i grad_i`` for weight (``[p, d]``) and bias (``[p]``), one matmul each."""
    a, g = _sequences(activations, backprops)
    sums = {}
    if layer.weight in weights:
        sums[layer.weight] = weighted_outer_sum(a, g, weights[layer.weight])
    if layer.bias is not None and layer.bias in weights:
        sums[layer.bias] = weighted_bias_sum(g, weights[layer.bias])
    return sums


@register_ghost_cost(nn.Linear)
def linear_prefers_ghost(layer: nn.Linear, activations: list[Tensor], backprops: Tensor) -> bool:
    """Ghost when ``T^2 (d + p)`` (times the device's :func:`ghost_cost_ratio`) beats ``T p d`` and
    ``T^2 <= p d``."""
    a, g = _sequences(activations, backprops)
    return prefer_ghost(a.shape[1], a.shape[2], g.shape[2], ghost_cost_ratio(g))


@register_use_merger(nn.Linear)
def linear_merge_uses(layer: nn.Linear, uses: list[Use]) -> Use:
    """Fold the uses of one backward into one call by concatenating positions (dim 1)."""
    pairs = [_sequences(acts, grads) for acts, grads in uses]
    return [torch.cat([a for a, _ in pairs], dim=1)], torch.cat([g for _, g in pairs], dim=1)
