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

Low-precision inputs (bf16/fp16) are promoted to float32 for sums (:func:`norm_dtype`).

Precision of the norms. A ghost norm is computed along another route than the clipped sum it
clips, so its rounding is not harmless as in hooks mode (where the clipped vector is the very
tensor whose norm was taken): if it comes out below the true norm, the sample's contribution
exceeds C. The identity cancels: when a sample's per-position terms ``g_t a_t^T`` nearly cancel,
the rounding of its Gram products (about ``u * M^2``, ``M = sum_t ||a_t|| ||g_t||``) dwarfs the true
``||G^T A||^2``; evaluated naively in float32 (or TF32) the result can be far below it, even
negative. So every ghost norm is returned as an UPPER BOUND of the exact norm of the per-sample
gradient of the given (float) A and G, rounded up to the result dtype:

- the Gram matrices (the costly ``B T^2 (d + p)`` part) are computed in the inputs' precision
  (float32 for float32 and 16-bit models, where float32 matrix products are IEEE on that device;
  else float64): each entry errs by at most ``gamma_d ||a_t|| ||a_s||`` (Higham's
  ``gamma_n = n u / (1 - n u)``, any summation order, with or without FMA), so their inner product
  errs by at most ``(gamma_d + gamma_p + gamma_d gamma_p) M^2``, and by much less when the positions
  are not aligned (each entry's error weighed by the other Gram's computed entry, :func:`gram_bounds`);
- their inner product (the sum over position pairs, where the identity cancels) and ``M`` (from
  the Grams' diagonals) are evaluated in float64, whose own round-off is bounded the same way
  (:func:`gram_bounds`);
- a sample whose float32 slack exceeds :data:`GRAM_SLACK_TOLERANCE` of its bound (a cancelling
  sample, or a layer with many aligned positions: a transformer under a loss on every token, whose
  slack is about ``gamma_p T`` of the norm) is recomputed from float32 Grams summed over feature
  chunks (:func:`chunked_gram`: ``gamma_~70`` per entry instead of ``gamma_d``, about 1.3x the time
  of one product, against about 3x and a float64 copy of both operands for float64 Grams); an
  operand of :data:`CHUNK_FIRST_MIN_WIDTH` features or more (an LM head's output gradient) is chunked
  at once. Those still loose are recomputed from float64 Grams, where the slack is ~1e-13 relative:
  every bound is within that tolerance of the exact norm unless the sample cancels beyond
  float64's reach too. Each stage's result is an upper bound by itself (the argument above with
  its own ``gamma``), so keeping the least of them keeps one.

Bias and embedding sums over positions are evaluated in float64 plus their worst-case round-off
(:func:`bias_sq_norms`, :func:`sum_sq_norm_bound`), unless a Gram of G is at hand (the bias norm is
the sum of its entries, :func:`gram_bounds` with ``A A^T`` all ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from dptrain.grad_sample.workspace import sample_chunks

#: ``(K_A [N, T, T], K_G [N, T, T], gamma_a, gamma_g)``: computed Grams and their entries' error bounds.
GramPair = tuple[Tensor, Tensor, float, float]
#: ``grams(dtype, rows) -> GramPair`` for the items ``rows`` (all when None), computed in ``dtype``.
GramSource = Callable[[torch.dtype, Optional[Tensor]], GramPair]

# Measured on the 2-core CPU of the build machine (scripts/benchmark_clipping.py --calibrate):
# time(ghost) / time(instantiate) ~= GHOST_COST_RATIO * T (d + p) / (p d), i.e. one ghost
# "flop" (a batched T x T Gram product) costs about this many instantiation "flops".
GHOST_COST_RATIO = 1.0

#: The same ratio per device type (:func:`ghost_cost_ratio`). CUDA is not measured: 0.5 takes the
#: ghost path up to twice instantiation's multiply-adds, because per-sample kernels (grouped
#: convolutions, batched outer products into ``[B, p, d]``) run far below a GPU's matrix-product
#: throughput and their per-sample gradients are what exhausts its memory, while Gram products
#: are batched matrix products. A conservative choice: it errs towards the path that keeps less.
GHOST_COST_RATIOS = {"cpu": GHOST_COST_RATIO, "cuda": 0.5}

#: Extra cost factor of the Gram products when they must run in float64 for a float32 model
#: (float32 products not IEEE on that device, :func:`gram_dtype`): about 2 on CPUs; 32 on CUDA,
#: where many GPUs run float64 at 1/32 to 1/64 of their float32 rate.
FLOAT64_GRAM_COST = {"cpu": 2.0, "cuda": 32.0}


#: Unit round-off of float64 (round to nearest).
FLOAT64_UNIT_ROUNDOFF = 2.0**-53


def norm_dtype(t: Tensor) -> torch.dtype:
    """The dtype norms are returned and sums computed in: float32 for 16-bit floats, else ``t.dtype``."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def float64_roundoff(terms: int | Tensor) -> float | Tensor:
    """``gamma_n = n u / (1 - n u)``, ``u = 2^-53``: the worst-case relative error of a float64 sum
    or dot product of ``n`` terms, in any order, with or without FMA (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2002, Lemma 3.1 and eq. 3.5). Elementwise for a tensor."""
    nu = terms * FLOAT64_UNIT_ROUNDOFF
    return nu / (1 - nu)


def inflated(value: Tensor, roundings: int) -> Tensor:
    """An upper bound of a non-negative quantity whose float64 evaluation ``value`` went through at
    most ``roundings`` relative roundings (each a factor in ``[1 - u, 1 + u]``): ``value`` divided
    by ``1 - gamma_{roundings + 2}``.

    The computed value is at least ``exact * (1 - gamma_k)`` (Higham, Lemma 3.1); the division and
    the rounding of its divisor err by at most ``2u``, and ``(1 - gamma_k)(1 - 2u) >= 1 - gamma_{k+2}``.
    """
    return value / (1 - float64_roundoff(roundings + 2))


def rounded_up(values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` (float64) cast to ``dtype``, rounded towards +inf: an upper bound stays one."""
    cast = values.to(dtype)
    if dtype == values.dtype:
        return cast
    low = cast.to(values.dtype) < values
    return torch.where(low, torch.nextafter(cast, cast.new_full((), float("inf"))), cast)


def _promote(t: Tensor) -> Tensor:
    """``t`` cast to :func:`norm_dtype` (no copy when it already has it)."""
    return t.to(norm_dtype(t))


def promoted(value: object) -> object:
    """A floating tensor detached and cast to :func:`norm_dtype` (float32 for 16-bit); any other
    value as it is (for ``tree_map`` over a layer's recorded inputs)."""
    return value.detach().to(norm_dtype(value)) if isinstance(value, Tensor) and value.is_floating_point() else value


def as_sequence(t: Tensor) -> Tensor:
    """View ``[B, *, f]`` as ``[B, T, f]`` (T = product of the middle dims; 1 for ``[B, f]``).

    Also for ``B = 0`` (an empty Poisson batch), where ``reshape(B, -1, f)`` is ambiguous.
    """
    return t.unsqueeze(1) if t.dim() == 2 else t.flatten(1, -2)


#: A float32 Gram bound whose round-off slack exceeds this fraction of the bound is recomputed
#: from float64 Grams: a norm is overestimated by at most 2^-11 (0.05%) relative. Measured slack
#: of the paper CNNs' ghost convolutions: 2e-5 to 3e-4 (``gamma`` times ``M^2 / ||G^T A||^2``, 1.4 to 19).
GRAM_SLACK_TOLERANCE = 2.0**-10


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit round-off ``u`` of float32 or float64 (round to nearest)."""
    return FLOAT64_UNIT_ROUNDOFF if dtype == torch.float64 else 2.0**-24


def roundoff(terms: int, dtype: torch.dtype) -> float:
    """``gamma_n`` of ``dtype``: the worst-case relative error of a sum or dot product of ``n`` terms."""
    nu = terms * unit_roundoff(dtype)
    return nu / (1 - nu)


def ieee_float32_matmul(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` are IEEE (not TF32 or bf16, which a user can
    enable with ``torch.backends.*.matmul.fp32_precision`` or ``torch.set_float32_matmul_precision``)."""
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    precision = backend.fp32_precision
    if precision == "none":
        precision = torch.backends.fp32_precision
    return precision in ("none", "ieee")


def gram_dtype(t: Tensor) -> torch.dtype:
    """Dtype of the Gram matrices of ``t``: float64 for float64 inputs and where float32 products
    are not IEEE (their round-off bound would not hold), else float32 (16-bit inputs too)."""
    if norm_dtype(t) == torch.float64 or not ieee_float32_matmul(t.device):
        return torch.float64
    return torch.float32


#: Grams over at least this many positions are computed by blocks of half the positions, three
#: of the four (:func:`gram`): 3/4 of the multiply-adds, about 0.85x the time of one ``bmm`` on CPU
#: at T = 128 (shorter sequences gain less than the extra calls cost).
BLOCK_GRAM_MIN_POSITIONS = 64


def gram(t: Tensor) -> Tensor:
    """``t t^T`` per sample: ``[N, T, f]`` -> ``[N, T, T]`` (in ``t``'s dtype).

    From :data:`BLOCK_GRAM_MIN_POSITIONS` positions on, the top-right block of half the positions
    is computed once and mirrored into the bottom-left one (a Gram matrix is symmetric). Every
    entry is still one computed ``f``-term dot product of two rows of ``t``, so the entry error
    bound of :func:`gram_bounds` holds as for one ``bmm``.
    """
    positions = t.shape[1]
    if positions < BLOCK_GRAM_MIN_POSITIONS:
        return torch.bmm(t, t.transpose(1, 2))
    half = positions // 2
    top, bottom = t[:, :half], t[:, half:]
    out = t.new_empty(t.shape[0], positions, positions)
    out[:, :half, :half] = torch.bmm(top, top.transpose(1, 2))
    corner = torch.bmm(top, bottom.transpose(1, 2))
    out[:, :half, half:] = corner
    out[:, half:, :half] = corner.transpose(1, 2)
    out[:, half:, half:] = torch.bmm(bottom, bottom.transpose(1, 2))
    return out


#: Feature width of the chunks of :func:`chunked_gram`: each entry's rounding bound counts the
#: roundings of one 64-term dot product plus two short sums, not of one ``f``-term dot product.
GRAM_CHUNK = 64

#: Widths from which a layer's Gram is chunked at once rather than recomputed when loose: there
#: even perfectly unaligned positions leave a slack near ``gamma_f`` of the norm, above
#: :data:`GRAM_SLACK_TOLERANCE` (a vocabulary-wide LM head's output gradient).
CHUNK_FIRST_MIN_WIDTH = 4096


def _chunk_layout(width: int) -> tuple[int, int]:
    """``(chunks, chunks per group)`` of :func:`chunked_gram` for ``width`` features."""
    chunks = -(-width // GRAM_CHUNK)
    return chunks, math.isqrt(chunks - 1) + 1  # ceil(sqrt(chunks))


def chunked_gram_roundings(width: int) -> int:
    """The most roundings on any product's path in :func:`chunked_gram` of ``width`` features
    (``width`` itself up to :data:`GRAM_CHUNK`): ``k`` in its chunk's ``k``-term dot product, ``g - 1``
    in its group's sum of ``g`` chunk results, ``G - 1`` in the sum of the ``G`` group results."""
    if width <= GRAM_CHUNK:
        return width
    chunks, per_group = _chunk_layout(width)
    groups = -(-chunks // per_group)
    return GRAM_CHUNK + (per_group - 1) + (groups - 1)


def chunked_gram(t: Tensor) -> Tensor:
    """``t t^T`` per sample (``[N, T, f]`` -> ``[N, T, T]``, ``t``'s dtype) as a sum over feature chunks.

    The features are cut into chunks of :data:`GRAM_CHUNK`; each chunk's Gram is one ``bmm`` (a
    ``k``-term dot product per entry, in whatever order the BLAS adds them), ``g ~ sqrt(chunks)``
    consecutive chunk Grams are added into a group sum one elementwise addition at a time, and the
    group sums likewise into the result. Each product ``t[i, t, j] t[i, s, j]`` thus goes through at
    most ``n = k + (g - 1) + (G - 1)`` roundings (:func:`chunked_gram_roundings`), so each entry errs by
    at most ``gamma_n sum_j |t_tj t_sj| <= gamma_n ||t_t|| ||t_s||`` (Higham, Lemma 3.1 and eq. 3.5;
    Cauchy-Schwarz), whatever order each BLAS call uses inside a chunk: ``n`` is ~130 for ``f = 3072``
    and ~120 for ``f = 50257``, not ``f``. Each call reads a strided slice (no copy); the chunk Grams
    of a ``[8, 128, f]`` input stay in cache: ~1.3x to 1.5x the time of :func:`gram` on CPU.
    """
    width = t.shape[2]
    if width <= GRAM_CHUNK:
        return gram(t)
    chunks, per_group = _chunk_layout(width)
    total: Optional[Tensor] = None
    for first in range(0, chunks, per_group):
        group: Optional[Tensor] = None
        for chunk in range(first, min(first + per_group, chunks)):
            x = t[:, :, chunk * GRAM_CHUNK : (chunk + 1) * GRAM_CHUNK]
            product = torch.bmm(x, x.transpose(1, 2))
            group = product if group is None else group.add_(product)
        total = group if total is None else total.add_(group)
    assert total is not None
    return total


def _weighted_abs_sum(gram: Tensor, weights: Tensor) -> Tensor:
    """``w^T |K| w`` per item: ``[N, T, T]``, ``[N, T]`` float64 -> ``[N]``."""
    return torch.bmm(gram.abs(), weights.unsqueeze(2)).squeeze(2).mul(weights).sum(dim=1)


def gram_bounds(gram_a: Tensor, gram_g: Tensor, gamma_a: float, gamma_g: float) -> tuple[Tensor, Tensor]:
    """Upper bounds of ``<K_A, K_G>`` from computed Grams, and their round-off slack, ``[N]`` float64.

    Args:
        gram_a, gram_g: ``[N, T, T]`` computed ``A A^T`` and ``G G^T`` (float32 or float64; an
            expanded all-ones ``gram_a`` with ``gamma_a = 0`` gives the bias norm ``||sum_t g_t||^2``).
        gamma_a, gamma_g: each entry's error bound relative to ``||a_t|| ||a_s||`` (resp. g).

    With ``E_A = K_A_hat - K_A`` (``|E_A[t,s]| <= gamma_a ||a_t|| ||a_s||``), ``E_G`` likewise, and
    ``M = sum_t ||a_t|| ||g_t||``: ``<K_A, K_G> - <K_A_hat, K_G_hat> = -<E_A, K_G_hat> - <K_A_hat, E_G>
    + <E_A, E_G>``, so the computed inner product errs by at most
    ``gamma_a alpha^T |K_G_hat| alpha + gamma_g beta^T |K_A_hat| beta + gamma_a gamma_g M^2`` with
    ``alpha_t >= ||a_t||``, ``beta_t >= ||g_t||``. This is never more than the plain
    ``(gamma_a + gamma_g + gamma_a gamma_g) M^2`` (up to a factor ``1 + gamma``) and far less when the
    positions' output gradients (or inputs) are not aligned: ``|K_G_hat[t,s]|`` is then much smaller
    than ``||g_t|| ||g_s||`` off the diagonal, and the slack shrinks from about ``gamma T`` times the
    squared norm towards ``gamma`` times it. ``||a_t||^2 <= K_A_hat[t,t] / (1 - gamma_a)`` (a computed
    sum of squares) gives ``alpha`` (and ``beta``), and ``M^2 <= (sum_t alpha_t beta_t)^2``. The float64
    sum of the ``T^2`` products (exact for float32 inputs) errs by at most ``gamma_{T^2+1}`` times
    their magnitudes, at most ``(1 + gamma_a)(1 + gamma_g) M^2`` (doubled for second-order terms).
    The bound is ``max(value, 0) + slack``, inflated for the final addition.

    Roundings of the slack, counted generously along any term's path (all its terms are
    non-negative): ``alpha_t`` 3 (the divisor, the division, the square root), a product
    ``alpha_t |K[t,s]| alpha_s`` 6 more with its two factors, the two sums of ``T`` terms
    ``2 (T - 1)``, the ``gamma`` factor 1 and the additions of the three parts 2: ``2 T + 10``;
    the ``M^2`` part ``T + 17`` as counted before. Inflated by ``gamma_{2T+22}`` (:func:`inflated`).
    """
    a, g = gram_a.double(), gram_g.double()
    positions = gram_a.shape[1]
    value = torch.linalg.vecdot(a.flatten(1), g.flatten(1)).clamp(min=0)
    alpha = (a.diagonal(dim1=1, dim2=2).clamp(min=0) / (1 - gamma_a)).sqrt()  # >= ||a_t||
    beta = (g.diagonal(dim1=1, dim2=2).clamp(min=0) / (1 - gamma_g)).sqrt()  # >= ||g_t||
    scale = (alpha * beta).sum(dim=1).square()  # >= M^2, up to its roundings
    entries = gamma_a * _weighted_abs_sum(g, alpha) + gamma_g * _weighted_abs_sum(a, beta)
    coefficient = gamma_a * gamma_g + 2 * float64_roundoff(positions * positions + 1) * (1 + gamma_a) * (1 + gamma_g)
    slack = inflated(entries + coefficient * scale, 2 * positions + 20)
    return inflated(value + slack, 1), slack


def _loose(bound: Tensor, slack: Tensor) -> Tensor:
    """Indices of the items whose slack exceeds :data:`GRAM_SLACK_TOLERANCE` of their bound."""
    return (slack > GRAM_SLACK_TOLERANCE * bound).nonzero().squeeze(1)


def tightened_gram_bounds(
    grams: GramSource, dtype: torch.dtype, items: int, chunked: Optional[GramSource] = None
) -> Tensor:
    """``[items]`` float64 upper bounds from ``grams(dtype, None)``; items whose slack exceeds
    :data:`GRAM_SLACK_TOLERANCE` of their bound are recomputed by ``chunked(dtype, rows)`` (Grams of
    the same precision with a tighter error bound, :func:`chunked_gram`) when given, and those still
    loose by ``grams(float64, rows)``. Every stage's bound is an upper bound: the least one is kept.

    ``grams(dtype, rows)`` returns ``(K_A, K_G, gamma_a, gamma_g)`` for the items ``rows`` (all when
    None), computed in ``dtype``.
    """
    bound, slack = gram_bounds(*grams(dtype, None))
    if dtype == torch.float64 or items == 0:
        return bound
    loose = _loose(bound, slack)
    if chunked is not None and loose.numel():
        tighter, slack = _recomputed(bound, loose, items, chunked, dtype)
        loose = loose[_loose(tighter, slack)]
    if loose.numel():
        _recomputed(bound, loose, items, grams, torch.float64)
    return bound


def _recomputed(
    bound: Tensor, loose: Tensor, items: int, grams: GramSource, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Lowers ``bound[loose]`` (in place) to the bounds from ``grams(dtype, loose rows)`` where they
    are less; returns those bounds and their slack, ``[len(loose)]``."""
    rows = None if loose.numel() == items else loose  # all of them: no gathered copy
    tighter, slack = gram_bounds(*grams(dtype, rows))
    if rows is None:
        torch.minimum(bound, tighter, out=bound)
    else:
        bound[loose] = torch.minimum(bound[loose], tighter)
    return tighter, slack


def _rows(t: Tensor, rows: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """``t[rows]`` (all rows when None) in ``dtype``."""
    return (t if rows is None else t[rows]).to(dtype)


def operand_gram(t: Tensor, chunked: bool = False) -> tuple[Tensor, float]:
    """``(t t^T, gamma)``: the Gram of ``t`` ``[N, T, f]`` in its dtype and each entry's error bound
    relative to ``||t_t|| ||t_s||``. Chunked (:func:`chunked_gram`) when asked or from
    :data:`CHUNK_FIRST_MIN_WIDTH` features on (float32 only: float64's ``gamma_f`` is tight enough)."""
    width = t.shape[2]
    if t.dtype != torch.float64 and (chunked or width >= CHUNK_FIRST_MIN_WIDTH):
        return chunked_gram(t), roundoff(chunked_gram_roundings(width), t.dtype)
    return gram(t), roundoff(width, t.dtype)


def outer_gram_pair(
    activations: Tensor, backprops: Tensor, gram_g: Optional[tuple[Tensor, float]] = None, chunked: bool = False
) -> GramSource:
    """The Grams of ``A`` ``[N, T, d]`` and ``G`` ``[N, T, p]`` (for :func:`tightened_gram_bounds`),
    chunked when ``chunked`` (:func:`operand_gram`); ``gram_g``: ``(G G^T, gamma)`` already computed by
    :func:`operand_gram` in :func:`gram_dtype` (reused for all rows of an unchunked source)."""

    def grams(dtype: torch.dtype, rows: Optional[Tensor]) -> GramPair:
        gram_a, gamma_a = operand_gram(_rows(activations, rows, dtype), chunked)
        reuse = gram_g is not None and rows is None and gram_g[0].dtype == dtype and not chunked
        gram_gg, gamma_g = gram_g if reuse else operand_gram(_rows(backprops, rows, dtype), chunked)
        return gram_a, gram_gg, gamma_a, gamma_g

    return grams


def chunked_outer_gram_pair(activations: Tensor, backprops: Tensor) -> Optional[GramSource]:
    """:func:`outer_gram_pair` with chunked Grams, or None when chunking would change neither Gram
    (both widths at most :data:`GRAM_CHUNK`, or chunked at once)."""
    widths = (activations.shape[2], backprops.shape[2])
    if all(w <= GRAM_CHUNK or w >= CHUNK_FIRST_MIN_WIDTH for w in widths):
        return None
    return outer_gram_pair(activations, backprops, chunked=True)


def ghost_sq_norm_bounds(activations: Tensor, backprops: Tensor) -> Tensor:
    """Upper bounds of the squared Frobenius norms of ``G_i^T A_i`` by the ghost identity, ``[B]``.

    Args:
        activations: A, ``[B, T, d]``.
        backprops: G, ``[B, T, p]``.

    Returns:
        ``[B]`` float64, never below the exact squared norm of the per-sample gradient of the
        given (float) A and G. For ``T == 1``, ``||a_i||^2 ||g_i||^2`` in float64 (squares of float32
        numbers are exact there) plus ``2 (gamma_d + gamma_p + gamma_1)`` of it; else the Gram
        identity (:func:`gram_bounds`, :func:`tightened_gram_bounds`).
    """
    positions, d, p = activations.shape[1], activations.shape[2], backprops.shape[2]
    if positions == 1:
        a, g = activations.double(), backprops.double()
        value = a.square().sum(dim=(1, 2)) * g.square().sum(dim=(1, 2))
        return value + 2 * (float64_roundoff(d) + float64_roundoff(p) + float64_roundoff(1)) * value
    grams = outer_gram_pair(activations, backprops)
    chunked = chunked_outer_gram_pair(activations, backprops)
    return tightened_gram_bounds(grams, gram_dtype(backprops), activations.shape[0], chunked)


def ghost_sq_norms(activations: Tensor, backprops: Tensor) -> Tensor:
    """:func:`ghost_sq_norm_bounds` rounded up to :func:`norm_dtype` of the backprops, ``[B]``."""
    return rounded_up(ghost_sq_norm_bounds(activations, backprops), norm_dtype(backprops))


def gram_bias_sq_norm_bounds(gram_g: Tensor, gamma_g: float, backprops: Tensor) -> Tensor:
    """Upper bounds of ``||sum_t g_t||^2 = sum_{t,s} K_G[t,s]`` from a computed Gram of G, ``[N]``
    float64; rows whose slack exceeds :data:`GRAM_SLACK_TOLERANCE` of the bound take the float64
    sum of their ``backprops`` ``[N, T, p]`` (:func:`bias_sq_norm_bounds`)."""
    ones = gram_g.new_ones(()).expand_as(gram_g)
    bound, slack = gram_bounds(ones, gram_g, 0.0, gamma_g)
    if gram_g.dtype != torch.float64:
        loose = _loose(bound, slack)
        if loose.numel():
            bound[loose] = bias_sq_norm_bounds(backprops if loose.numel() == len(bound) else backprops[loose])
    return bound


def sum_sq_norm_bound(sq_norm: Tensor, row_norms: Tensor, rows: int | Tensor, width: int) -> Tensor:
    """Upper bound of ``||s||^2`` for a sum of rows ``s`` evaluated in float64 as ``s_hat``.

    Args:
        sq_norm: ``fl(||s_hat||^2)``, ``[B]`` float64 (squares of ``width``-wide sums, summed over
            at most ``rows * width`` terms).
        row_norms: ``sum_t ||v_t||`` over the rows added, ``[B]`` float64.
        rows: the most rows added into one sum (int, or ``[B]`` per sample).
        width: the number of features of a row.

    Each feature of ``s_hat`` errs by at most ``gamma_rows sum_t |v_t|``, so
    ``||s|| <= ||s_hat|| + gamma_rows * row_norms``, and ``||s_hat||^2 <= sq_norm / (1 - gamma)``.
    """
    exact_part = (sq_norm.clamp(min=0) / (1 - float64_roundoff(rows * width))).sqrt()
    return (exact_part + float64_roundoff(rows) * row_norms).square()


def summed_upper_bound(bounds: list[Tensor], scale: float, dtype: torch.dtype) -> Tensor:
    """Upper bound of ``scale * sum(bounds)``, rounded up to ``dtype``, ``[B]``.

    Args:
        bounds: upper bounds of the terms of one squared norm (for tied layers: both layers'
            norms and twice their cross term, which may be negative and cancel the others).
        scale: a non-negative factor (the mean loss's ``B^2``).

    The terms are scaled and added in float64 and the worst-case round-off of that sum
    (``gamma_{n+1}`` times the terms' magnitudes) is added: adding them in a float32 result would
    round to nearest, and a cancelling sum could come out below the exact norm.
    """
    terms = [b.double() * scale for b in bounds]
    total = torch.stack(terms).sum(dim=0)
    magnitude = torch.stack(terms).abs().sum(dim=0)
    return rounded_up(total + float64_roundoff(len(terms) + 1) * magnitude, dtype)


def outer_product_grads(activations: Tensor, backprops: Tensor) -> Tensor:
    """Per-sample weight gradients ``G_i^T A_i``, shape ``[B, p, d]`` (in :func:`norm_dtype`)."""
    return torch.bmm(_promote(backprops).transpose(1, 2), _promote(activations))


def instantiated_sq_norms(activations: Tensor, backprops: Tensor) -> Tensor:
    """Squared norms of ``G_i^T A_i`` by forming them: ``[B, T, d]``, ``[B, T, p]`` -> ``[B]``."""
    return sq_norms(outer_product_grads(activations, backprops))


def bias_grads(backprops: Tensor) -> Tensor:
    """Per-sample bias gradients ``sum_t G_i[t]``: ``[B, T, p]`` -> ``[B, p]`` (norm dtype)."""
    return _promote(backprops).sum(dim=1)


def bias_sq_norm_bounds(backprops: Tensor) -> Tensor:
    """Upper bounds of ``||sum_t G_i[t]||^2``: ``[B, T, p]`` -> ``[B]`` float64.

    The positions' gradients can cancel, so the sum is taken in float64 and bounded
    (:func:`sum_sq_norm_bound`); the clipped sum adds the positions in another order.
    """
    g = backprops.double()
    positions, width = g.shape[1], g.shape[2]
    sq_norm = g.sum(dim=1).square().sum(dim=1)
    row_norms = torch.linalg.vector_norm(g, dim=2).sum(dim=1)
    return sum_sq_norm_bound(sq_norm, row_norms, positions, width)


def bias_sq_norms(backprops: Tensor) -> Tensor:
    """:func:`bias_sq_norm_bounds` rounded up to :func:`norm_dtype`: ``[B, T, p]`` -> ``[B]``."""
    return rounded_up(bias_sq_norm_bounds(backprops), norm_dtype(backprops))


def promoted_rows(per_sample: Tensor) -> list[Tensor]:
    """``per_sample`` ``[B, *shape]`` as ``[b, numel]`` row chunks in :func:`norm_dtype`.

    Float32/64 tensors come back as one view (no copy); 16-bit ones are converted to float32 one
    chunk of samples at a time, each chunk at most the size of one float32 copy of a sample's
    tensor or :data:`~dptrain.grad_sample.workspace.MIN_WORKSPACE` elements, so that a large
    parameter's per-sample gradients never get a float32 copy in full.
    """
    flat = per_sample.reshape(per_sample.shape[0], -1)
    if norm_dtype(flat) == flat.dtype:
        return [flat]
    return [flat[rows].to(norm_dtype(flat)) for rows in sample_chunks(flat.shape[0], flat.shape[1], flat.shape[1])]


def sq_norms(per_sample: Tensor) -> Tensor:
    """Squared L2 norm of each sample's tensor: ``[B, *shape]`` -> ``[B]`` (norm dtype).

    A norm reduction, not ``square().sum()``: no temporary as large as ``per_sample`` (for an
    instantiated layer that copy would add its per-sample gradients' size to the peak memory);
    16-bit rows are converted to float32 by chunks (:func:`promoted_rows`) so that the norm of the
    very values :func:`weighted_sample_sum` adds up is taken in float32, not rounded to 16 bits.
    """
    norms = [torch.linalg.vector_norm(rows, dim=1) for rows in promoted_rows(per_sample)]
    return (norms[0] if len(norms) == 1 else torch.cat(norms)).square()  # one chunk: no copy


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
    """``sum_i w_i sum_t G_i[t]``: ``[B, T, p]``, ``[B]`` -> ``[p]`` (norm dtype).

    One vector-matrix product over the samples (``[B] @ [B, T p]``), then a sum over the positions
    of the contiguous ``[T, p]`` result: reducing ``[B, T, p]`` over its first two dims in one call
    (einsum) is a strided reduction, about 15x slower on CPU.
    """
    g = _promote(backprops)
    batch, positions, width = g.shape
    return (weights.to(g.dtype) @ g.reshape(batch, positions * width)).view(positions, width).sum(dim=0)


def dropped_samples(weights: Mapping[Any, Tensor]) -> Optional[Tensor]:
    """The samples a weighted sum leaves out: ``Tensor[B]`` bool, True where a sample's weight is
    0 for some parameter; None when no weight is 0 (the usual case: nothing to do).

    A zero weight is a strong zero: the sample's values never reach the sum, since ``0 * NaN`` and
    ``0 * inf`` are NaN (:mod:`dptrain.privacy.clipping` gives a sample whose gradient is not
    finite the factor 0). One wait for the accelerator per call, not per parameter.
    """
    distinct = list({id(w): w for w in weights.values()}.values())
    if not distinct:
        return None
    if len(distinct) == 1:  # flat clipping: one factor tensor for every parameter
        zero = distinct[0] == 0
    else:
        device = distinct[0].device
        zero = torch.stack([(w == 0).to(device) for w in distinct]).any(dim=0)
    return zero if bool(zero.any()) else None


def without_rows(value: Any, dropped: Optional[Tensor], dim: int = 0) -> Any:
    """``value`` (a tensor, or tensors in lists, tuples, dicts) with the rows of the ``dropped``
    samples (``Tensor[B]`` bool, from :func:`dropped_samples`) zeroed at the batch dimension ``dim``
    in every floating tensor that has ``B`` rows there; a copy only where something is dropped.

    Integer tensors (token ids) are finite and stay as they are; so does everything when
    ``dropped`` is None.
    """
    if dropped is None:
        return value

    def zeroed(t: Any) -> Any:
        if not (isinstance(t, Tensor) and t.is_floating_point() and t.dim() > dim
                and t.shape[dim] == dropped.numel()):
            return t
        shape = [1] * t.dim()
        shape[dim] = -1
        return t.masked_fill(dropped.to(t.device).view(shape), 0)

    return tree_map(zeroed, value)


def weighted_sample_sum(per_sample: Tensor, weights: Tensor, dropped: Optional[Tensor] = None) -> Tensor:
    """``sum_i w_i X_i`` for per-sample tensors: ``[B, *shape]``, ``[B]`` -> ``shape`` (norm dtype).

    A matrix-vector product per chunk of :func:`promoted_rows`, accumulated in float32 for 16-bit
    tensors: a 16-bit result would round each sample's clipped contribution (by up to 2^-8 of it in
    bf16), above the clipping bound. The rows of the ``dropped`` samples (``Tensor[B]`` bool, see
    :func:`dropped_samples`) are zeroed first (their values may be NaN); None: every row counts.
    """
    chunks = promoted_rows(per_sample)
    if len(chunks) == 1 and dropped is None and weights.shape[0] == chunks[0].shape[0]:
        # the usual case: one product, no slicing
        return (weights.to(chunks[0].dtype) @ chunks[0]).view(per_sample.shape[1:])
    total = None
    start = 0
    for rows in chunks:
        if dropped is not None:
            rows = without_rows(rows, dropped[start : start + rows.shape[0]])
        part = weights[start : start + rows.shape[0]].to(rows.dtype) @ rows
        total = part if total is None else total.add_(part)
        start += rows.shape[0]
    return total.view(per_sample.shape[1:])


def ghost_cost(positions: int, in_features: int, out_features: int) -> float:
    """Relative per-sample cost of the ghost norm: ``ratio * T^2 (d + p)`` (flop units, CPU)."""
    return GHOST_COST_RATIO * positions * positions * (in_features + out_features)


def instantiate_cost(positions: int, in_features: int, out_features: int) -> float:
    """Relative per-sample cost of forming the gradient: ``T p d`` (flop units)."""
    return float(positions * in_features * out_features)


def ghost_cost_ratio(t: Tensor) -> float:
    """Cost of one Gram multiply-add in per-sample-gradient multiply-adds for a layer whose output
    gradient is ``t``: :data:`GHOST_COST_RATIOS` of its device type (other devices: CUDA's), times
    :data:`FLOAT64_GRAM_COST` when its Grams must run in float64 though ``t`` is not float64."""
    device = t.device.type if t.device.type in GHOST_COST_RATIOS else "cuda"
    ratio = GHOST_COST_RATIOS[device]
    if gram_dtype(t) == torch.float64 and norm_dtype(t) != torch.float64:
        ratio *= FLOAT64_GRAM_COST[device]
    return ratio


def prefer_ghost(positions: int, in_features: int, out_features: int, ratio: float = GHOST_COST_RATIO) -> bool:
    """True when the ghost norm is cheaper than instantiation for a ``[T, d] -> [T, p]`` layer.

    Both time (``ratio * T^2 (d + p) <= T p d``, ``ratio`` from :func:`ghost_cost_ratio`) and memory
    (``T^2`` Gram matrices vs a ``p x d`` gradient per sample) are compared; ghost wins ties since
    it keeps no per-sample gradient.
    """
    t, d, p = positions, in_features, out_features
    cheaper = ratio * t * t * (d + p) <= instantiate_cost(t, d, p)
    smaller = t * t <= p * d
    return cheaper and smaller
