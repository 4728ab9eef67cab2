"""The outer-product algebra behind ghost clipping, as pure functions of (A, G).

Every layer whose weight gradient is a sum of outer products (Linear, Conv after unfolding, the
linear pieces of the DP layers) reduces to one form. For sample ``i`` with ``T`` positions
(sequence steps, spatial locations, or the uses of a weight-shared layer, all concatenated):

- ``A[i]``: ``[T, d]`` the layer inputs (activations), ``d`` input features;
- ``G[i]``: ``[T, p]`` the gradients of sample ``i``'s own loss w.r.t. the layer outputs;
- the per-sample weight gradient is ``G[i]^T A[i]`` (``[p, d]``) and the bias gradient
  ``sum_t G[i, t]`` (``[p]``).

Squared per-sample norms can be obtained two ways:

- *ghost* (Goodfellow 2015; Li et al. 2022): ``||G_i^T A_i||_F^2 = <A_i A_i^T, G_i G_i^T>``, cost
  ``~ B T^2 (d + p)`` flops and ``B T^2`` memory, never forming a ``[p, d]`` tensor per sample;
- *instantiate*: form ``G_i^T A_i`` and square it, cost ``~ B T p d`` flops and ``B p d`` memory.

:func:`prefer_ghost` picks the cheaper one (mixed ghost clipping, Bu et al. 2022) with a constant
calibrated on CPU (see ``scripts/benchmark_clipping.py --calibrate``). The clipped sum
``sum_i c_i G_i^T A_i`` is one matmul of the reweighted G with A (book-keeping, Bu et al. 2023).

Low-precision inputs (bf16/fp16) are promoted to float32 for norms and sums (:func:`norm_dtype`).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Measured on the 2-core CPU of the build machine (scripts/benchmark_clipping.py --calibrate):
# time(ghost) / time(instantiate) ~= GHOST_COST_RATIO * T (d + p) / (p d), i.e. one ghost
# "flop" (a batched T x T Gram product) costs about this many instantiation "flops".
GHOST_COST_RATIO = 1.0


def norm_dtype(t: Tensor) -> torch.dtype:
    """The dtype norms and sums are computed in: float32 for 16-bit floats, else ``t.dtype``."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _promote(t: Tensor) -> Tensor:
    """``t`` cast to :func:`norm_dtype` (no copy when it already has it)."""
    return t.to(norm_dtype(t))


def as_sequence(t: Tensor) -> Tensor:
    """View ``[B, *, f]`` as ``[B, T, f]`` (T = product of the middle dims; 1 for ``[B, f]``).

    Also for ``B = 0`` (an empty Poisson batch), where ``reshape(B, -1, f)`` is ambiguous.
    """
    return t.unsqueeze(1) if t.dim() == 2 else t.flatten(1, -2)


def ghost_sq_norms(activations: Tensor, backprops: Tensor) -> Tensor:
    """Squared Frobenius norms of ``G_i^T A_i`` by the ghost identity, shape ``[B]``.

    Args:
        activations: A, ``[B, T, d]``.
        backprops: G, ``[B, T, p]``.

    For ``T == 1`` this is ``||a_i||^2 ||g_i||^2``; otherwise ``sum_{t,s} (A A^T)_{ts} (G G^T)_{ts}``.
    """
    a, g = _promote(activations), _promote(backprops)
    if a.shape[1] == 1:
        return a.square().sum(dim=(1, 2)) * g.square().sum(dim=(1, 2))
    gram_a = torch.bmm(a, a.transpose(1, 2))  # [B, T, T]
    gram_g = torch.bmm(g, g.transpose(1, 2))  # [B, T, T]
    return torch.linalg.vecdot(gram_a.flatten(1), gram_g.flatten(1))


def outer_product_grads(activations: Tensor, backprops: Tensor) -> Tensor:
    """Per-sample weight gradients ``G_i^T A_i``, shape ``[B, p, d]`` (in :func:`norm_dtype`)."""
    return torch.bmm(_promote(backprops).transpose(1, 2), _promote(activations))


def instantiated_sq_norms(activations: Tensor, backprops: Tensor) -> Tensor:
    """Squared norms of ``G_i^T A_i`` by forming them: ``[B, T, d]``, ``[B, T, p]`` -> ``[B]``."""
    return sq_norms(outer_product_grads(activations, backprops))


def bias_grads(backprops: Tensor) -> Tensor:
    """Per-sample bias gradients ``sum_t G_i[t]``: ``[B, T, p]`` -> ``[B, p]`` (norm dtype)."""
    return _promote(backprops).sum(dim=1)


def sq_norms(per_sample: Tensor) -> Tensor:
    """Squared L2 norm of each sample's tensor: ``[B, *shape]`` -> ``[B]`` (norm dtype).

    A norm reduction, not ``square().sum()``: no temporary as large as ``per_sample`` (for an
    instantiated layer that copy would add its per-sample gradients' size to the peak memory).
    """
    return torch.linalg.vector_norm(_promote(per_sample).reshape(per_sample.shape[0], -1), dim=1).square()


def weighted_outer_sum(activations: Tensor, backprops: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i G_i^T A_i`` as one matmul, shape ``[p, d]`` (norm dtype).

    Args:
        activations: A, ``[B, T, d]``.
        backprops: G, ``[B, T, p]``.
        weights: w, ``[B]`` (clipping factors, possibly times other per-sample weights).
    """
    a, g = _promote(activations), _promote(backprops)
    w = weights.to(g.dtype).view(-1, 1, 1)
    if a.shape[-1] <= g.shape[-1]:  # reweight the smaller of the two operands
        a = a * w
    else:
        g = g * w
    return g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1])


def weighted_bias_sum(backprops: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i sum_t G_i[t]``: ``[B, T, p]``, ``[B]`` -> ``[p]`` (norm dtype)."""
    g = _promote(backprops)
    return torch.einsum("btp,b->p", g, weights.to(g.dtype))


def weighted_sample_sum(per_sample: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i X_i`` for instantiated per-sample tensors: ``[B, *shape]``, ``[B]`` -> shape."""
    x = _promote(per_sample)
    return torch.tensordot(weights.to(x.dtype), x, dims=([0], [0]))


def ghost_cost(positions: int, in_features: int, out_features: int) -> float:
    """Relative per-sample cost of the ghost norm: ``ratio * T^2 (d + p)`` (flop units)."""
    return GHOST_COST_RATIO * positions * positions * (in_features + out_features)


def instantiate_cost(positions: int, in_features: int, out_features: int) -> float:
    """Relative per-sample cost of forming the gradient: ``T p d`` (flop units)."""
    return float(positions * in_features * out_features)


def prefer_ghost(positions: int, in_features: int, out_features: int) -> bool:
    """True when the ghost norm is cheaper than instantiation for a ``[T, d] -> [T, p]`` layer.

    Both time (the calibrated flop model) and memory (``T^2`` Gram matrices vs a ``p x d``
    gradient per sample) are compared; ghost wins ties since it keeps no per-sample gradient.
    """
    t, d, p = positions, in_features, out_features
    cheaper = ghost_cost(t, d, p) <= instantiate_cost(t, d, p)
    smaller = t * t <= p * d
    return cheaper and smaller
