"""Ghost rules for ``nn.Embedding`` and ``nn.EmbeddingBag``: never a vocabulary-sized tensor.

Embedding: sample ``i``'s weight gradient is ``sum_t onehot(x_{i,t}) g_{i,t}^T`` (``[V, D]``), whose
squared norm is ``sum_{t,s: x_t = x_s} <g_t, g_s>``: the pairs of equal token ids. Two routes:

- *count identity* (a model that pools the embeddings by a sum or mean, as the IMDb embedding
  network: every position of a sample gets the same gradient ``g_i``): the gradient is
  ``c_i g_i^T`` with ``c_i`` the sample's token-count vector, so its squared norm is
  ``||c_i||^2 ||g_i||^2``; ``||c_i||^2 = sum_v c_{i,v}^2`` is an exact integer from one sort of the
  ``(sample, token)`` keys (duplicates counted, never compared pairwise). Taken when every position
  of every sample holds bitwise the same gradient (checked in one pass over G).
- *segment sums* (any gradients): the gradients of equal ``(sample, token)`` keys are added up
  (one sort of the ``B T`` keys and one row sum) and squared: ``sum_{keys} ||sum_{t in key} g_t||^2``
  equals the pair sum, in ``O(B T D)``.

Positions holding ``padding_idx`` get no gradient and are dropped.

EmbeddingBag (mode "sum" or "mean", optional ``per_sample_weights``): each bag is a sample; its
gradient is ``sum_t u_t onehot(x_t) g_bag^T`` with ``u_t`` the token's weight (times 1/len for
"mean"), so its squared norm is ``||g_bag||^2 * sum_{tokens v} (sum_{t: x_t = v} u_t)^2``: the
count identity with the weighted counts (without ``per_sample_weights``: the exact integer
``||c||^2``, over ``len^2`` for "mean").

Clipped sums are one accumulating ``index_put_`` of the reweighted gradients into a ``[V, D]``
buffer (the dense gradient autograd would produce; 2-5x faster on CPU than the embedding's own
backward kernel, which adds one row at a time). Under the count identity the ``[B, D]`` gradients
are broadcast over each sample's positions, never copied per position.

Equal tokens' gradients can cancel, so the segment sums are added up in float64 and every norm is
returned as an upper bound (:func:`~dptrain.grad_sample.ghost_math.sum_sq_norm_bound`,
:func:`~dptrain.grad_sample.ghost_math.inflated`), as every ghost norm.

Tied to a Linear head (``head.weight is embedding.weight``, ``[V, D]``): sample i's gradient of the
shared weight is ``E_i + H_i`` with ``E_i = sum_t onehot(x_t) e_t^T`` (``e_t`` the embedding's output
gradient at position t) and ``H_i = G_i^T A_i`` (the head's inputs ``A_i`` ``[S, D]`` and output
gradients ``G_i`` ``[S, V]``). The cross term of its squared norm is
``<E_i, H_i> = sum_{t, s} G_i[s, x_t] <e_t, A_i[s]>``: a ``[S, T]`` product per sample, evaluated in
float64 and returned as an upper bound like the norms.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.embedding import _bags, _check_embedding
from dptrain.grad_sample.ghost_math import (
    as_sequence,
    float64_roundoff,
    inflated,
    norm_dtype,
    rounded_up,
    sum_sq_norm_bound,
)
from dptrain.grad_sample.ghost_registry import (
    Use,
    Weights,
    register_clipped_sum,
    register_cross_term,
    register_row_grouper,
    register_use_compactor,
)
from dptrain.grad_sample.registry import register_norm_sampler


def _row_sums(indices: Tensor, values: Tensor, num_rows: int) -> Tensor:
    """``out[k] = sum_{n: indices[n] = k} values[n]``: ``[*N]``, ``[*N, D]`` -> ``[num_rows, D]``.

    ``values`` may be any tensor broadcastable to ``[*N, D]`` (``[B, 1, D]`` for ``[B, L]``
    indices: one row per sample). Always deterministic: an accumulating ``index_put_`` where it runs
    serially (CPU on one thread or under deterministic algorithms; on CUDA it sorts), else
    ``index_add_`` (serial over the indices): on more than one CPU thread ``index_put_`` adds with
    atomics, in a varying order and up to 10x slower. Both are 2-5x faster than the embedding's
    own backward kernel, which adds one row at a time.
    """
    out = values.new_zeros(num_rows, values.shape[-1])
    serial_put = out.device.type != "cpu" or torch.get_num_threads() == 1 or torch.are_deterministic_algorithms_enabled()
    if serial_put:
        return out.index_put_((indices,), values, accumulate=True)
    rows = values.expand(*indices.shape, values.shape[-1]).reshape(-1, values.shape[-1])
    return out.index_add_(0, indices.reshape(-1), rows)


def _pair_counts(ids: Tensor, owners: Tensor, num_embeddings: int, batch: int) -> Tensor:
    """``sum_v c_{i,v}^2`` per owner, ``[B]`` int64 (exact): ``c_{i,v}`` counts ``ids[n] == v`` with
    ``owners[n] == i`` (both ``[N]``). One sort of the ``(owner, id)`` keys; the sorted keys are
    owner-major, so each owner's squared counts are one segment of their running sum."""
    keys = _keys(ids, owners, num_embeddings, batch)
    unique, counts = torch.unique(keys, return_counts=True)
    first_keys = torch.arange(1, batch + 1, dtype=unique.dtype, device=unique.device) * num_embeddings
    ends = torch.searchsorted(unique, first_keys)  # owner i's keys end where owner i + 1's begin
    running = torch.cat([counts.new_zeros(1), (counts * counts).cumsum(0)])
    return running.index_select(0, ends).diff(prepend=counts.new_zeros(1))


def _keys(ids: Tensor, owners: Tensor, num_embeddings: int, batch: int) -> Tensor:
    """``owner * V + id`` per position, ``[N]``: int32 when ``B V`` fits (radix-sorted by torch on
    CPU, about twice as fast as int64), else int64."""
    keys = owners * num_embeddings + ids
    return keys.int() if batch * num_embeddings < 2**31 else keys


def _segment_sq_norms(ids: Tensor, values: Tensor, owners: Tensor, num_embeddings: int, batch: int) -> Tensor:
    """Upper bounds of ``sum over keys k of ||sum_{n: key n = k} values[n]||^2`` per owner, ``[B]``.

    Args:
        ids: ``[N]`` token ids; the keys are ``(owners[n], ids[n])``.
        values: ``[N, D]`` rows to add up per key.
        owners: ``[N]`` the sample each row belongs to.
        batch: B.

    Returns:
        ``[B]`` float64: the sums evaluated in float64 plus the bound of their round-off (at most
        an owner's row count added into one key).
    """
    values = values.double()
    unique, inverse = torch.unique(_keys(ids, owners, num_embeddings, batch), return_inverse=True)
    key_owner = (unique // num_embeddings).long()
    summed = _row_sums(inverse, values, key_owner.shape[0])  # [K, D]
    per_key = summed.square().sum(dim=1)
    sq_norm = per_key.new_zeros(batch).index_add_(0, key_owner, per_key)
    row_norms = values.new_zeros(batch).index_add_(0, owners, torch.linalg.vector_norm(values, dim=1))
    rows = torch.bincount(owners, minlength=batch).to(values.dtype)
    return sum_sq_norm_bound(sq_norm, row_norms, rows, values.shape[1])


def _count_identity_bound(grads: Tensor, token_mass: Tensor, roundings: int = 0) -> Tensor:
    """Upper bound of ``token_mass * ||g||^2`` per sample, ``[B]`` float64.

    Args:
        grads: g, ``[B, D]``.
        token_mass: ``[B]`` float64, the weighted counts' squared norm, exact or computed with
            ``roundings`` relative roundings (an integer count: 0; over ``len^2``: 2).

    ``||g||^2`` is a float64 sum of ``D`` squares (``gamma_D`` relative), times the mass (one more
    rounding): :func:`~dptrain.grad_sample.ghost_math.inflated` covers them all.
    """
    sq = grads.double().square().sum(dim=1)
    return inflated(sq * token_mass, grads.shape[1] + 1 + roundings)


def shared_position_grads(backprops: Tensor) -> Optional[Tensor]:
    """``g`` ``[B, D]`` when every position of each sample got bitwise the same gradient, else None.

    ``backprops`` is ``[B, *, D]``. A sum- or mean-pooled embedding's output gradient has this form
    (``emb(x).mean(1)``: ``g_i / T`` at every position). One comparison pass, no copy; none for the
    broadcast view :func:`embedding_compact_use` keeps.
    """
    rows = backprops.reshape(backprops.shape[0], -1, backprops.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 0 and not torch.equal(rows[:, 1:], rows[:, :-1]):
        return None
    return rows[:, 0]


@register_use_compactor(nn.Embedding)
def embedding_compact_use(layer: nn.Embedding, activations: list[Tensor], backprops: Tensor) -> Use:
    """The use with a shared output gradient (:func:`shared_position_grads`) kept as a broadcast
    view of its ``[B, 1, D]`` rows: the ``[B, T, D]`` gradient is freed at once."""
    shared = shared_position_grads(backprops)
    if shared is None:
        return activations, backprops
    rows = shared.clone()  # a copy: a view of the gradient would keep all of it alive
    middle = [1] * (backprops.dim() - 2)
    return activations, rows.view(rows.shape[0], *middle, rows.shape[1]).expand(backprops.shape)


@register_row_grouper(nn.Embedding)
def embedding_concat_positions(layer: nn.Embedding, uses: list[Use]) -> Use:
    """Fold uses of the same rows into one by concatenating their positions: ids ``[B, *]`` ->
    ``[B, N]``, gradients ``[B, *, D]`` -> ``[B, N, D]``. Row i's gradient of the sum of uses is
    ``sum_t onehot(x_t) g_t^T`` over all of them, which every Embedding rule reads as one use.

    Registered to group the examples of a user (user-level ghost clipping), not as a use merger:
    a merger would also change which layers example-level ghost mode instantiates."""
    ids = torch.cat([acts[0].reshape(acts[0].shape[0], -1) for acts, _ in uses], dim=1)
    grads = torch.cat([g.reshape(g.shape[0], -1, g.shape[-1]) for _, g in uses], dim=1)
    return [ids], grads


def _token_ids(layer: nn.Embedding, tokens: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(token ids [N], owner sample [N], kept [B * T] or None)`` of ``[B, *]`` tokens: the
    ``padding_idx`` positions dropped (``kept`` marks the others; None without padding)."""
    ids = tokens.reshape(tokens.shape[0], -1)
    owners = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids).reshape(-1)
    ids = ids.reshape(-1)
    if layer.padding_idx is None:
        return ids, owners, None
    kept = ids != layer.padding_idx
    return ids[kept], owners[kept], kept


def _token_rows(layer: nn.Embedding, tokens: Tensor, backprops: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten to (token ids ``[N]``, gradient rows ``[N, D]``, owner sample ``[N]``), padding dropped."""
    ids, owners, kept = _token_ids(layer, tokens)
    rows = backprops.reshape(-1, backprops.shape[-1]).to(norm_dtype(backprops))
    return ids, rows if kept is None else rows[kept], owners


@register_norm_sampler(nn.Embedding)
def embedding_norms(layer: nn.Embedding, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """``{weight: [B]}``: squared norms (upper bounds) from ``[B, *]`` token ids and ``[B, *, D]``
    gradients, by the count identity when the gradients are shared by each sample's positions."""
    _check_embedding(layer)
    tokens, batch, vocab = activations[0], backprops.shape[0], layer.num_embeddings
    shared = shared_position_grads(backprops)
    if shared is not None:
        ids, owners, _ = _token_ids(layer, tokens)
        bounds = _count_identity_bound(shared, _pair_counts(ids, owners, vocab, batch).double())
    else:
        ids, rows, owners = _token_rows(layer, tokens, backprops)
        bounds = _segment_sq_norms(ids, rows, owners, vocab, batch)
    return {layer.weight: rounded_up(bounds, norm_dtype(backprops))}


def _zero_padding_row(layer: nn.Embedding | nn.EmbeddingBag, summed: Tensor) -> Tensor:
    """``summed`` with the ``padding_idx`` row zeroed (that row gets no gradient in torch)."""
    if layer.padding_idx is not None:
        summed[layer.padding_idx] = 0
    return summed


@register_clipped_sum(nn.Embedding)
def embedding_clipped_sum(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``{weight: sum_i w_i grad_i}`` (``[V, D]``) by one accumulating ``index_put_`` of reweighted
    rows (per sample, broadcast over its positions, when they share one gradient)."""
    if layer.weight not in weights:
        return {}
    _check_embedding(layer)
    dtype = norm_dtype(backprops)
    w = weights[layer.weight].to(dtype)
    shared = shared_position_grads(backprops)
    if shared is not None:
        tokens = activations[0].reshape(backprops.shape[0], -1)
        scaled = (shared.to(dtype) * w.unsqueeze(1)).unsqueeze(1)  # [B, 1, D]
        return {layer.weight: _zero_padding_row(layer, _row_sums(tokens, scaled, layer.num_embeddings))}
    ids, rows, owners = _token_rows(layer, activations[0], backprops)
    return {layer.weight: _row_sums(ids, rows * w[owners].unsqueeze(1), layer.num_embeddings)}


def _bag_tokens(layer: nn.EmbeddingBag, activations: list[Tensor], batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """(token ids ``[N]``, token weights ``u`` ``[N]``, bag of each token ``[N]``) of ``batch`` bags.

    Both input forms (``[B, L]`` ids, or 1-D ids with ``offsets``; optional
    ``per_sample_weights``) are read by the grad sampler's parser; padding tokens get ``u = 0``.
    """
    _check_embedding(layer)
    if layer.mode not in ("sum", "mean"):
        raise UnsupportedModuleError(
            f"EmbeddingBag(mode={layer.mode!r}) has no ghost norm: its gradient depends on which "
            f"token wins the max per feature (and no per-sample gradient rule either). Use mode='sum' "
            f"or 'mean'."
        )
    ids, bags, u = _bags(layer, activations, batch)
    return ids, u, bags


def _has_token_weights(activations: list[Tensor]) -> bool:
    """Whether an EmbeddingBag call passed ``per_sample_weights`` (third positional input)."""
    return len(activations) > 2 and activations[2] is not None


def _bag_token_mass(layer: nn.EmbeddingBag, activations: list[Tensor], batch: int) -> tuple[Tensor, int]:
    """``(sum_v (sum_{t: x_t = v} u_t)^2 per bag [B] float64, its relative roundings)``.

    Without ``per_sample_weights`` every kept token of a bag has the same weight (1, or 1/len for
    "mean"): the mass is the exact pair count (over ``len^2``). With them, the weights of equal
    tokens are added up in float64 (they may cancel): a bound from :func:`_segment_sq_norms`.
    """
    ids, u, bags = _bag_tokens(layer, activations, batch)
    if _has_token_weights(activations):
        return _segment_sq_norms(ids, u.unsqueeze(1), bags, layer.num_embeddings, batch), 0
    kept = u != 0  # padding tokens
    ids, bags = ids[kept], bags[kept]
    pairs = _pair_counts(ids, bags, layer.num_embeddings, batch).double()
    if layer.mode == "sum":
        return pairs, 0
    lengths = torch.bincount(bags, minlength=batch).clamp(min=1).double()
    return pairs / lengths.square(), 2


@register_norm_sampler(nn.EmbeddingBag)
def embedding_bag_norms(
    layer: nn.EmbeddingBag, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """``{weight: [B]}`` for ``B`` bags with output gradients ``[B, D]`` (upper bounds):
    ``token_mass * ||g_bag||^2`` (:func:`_bag_token_mass`, :func:`_count_identity_bound`)."""
    token_mass, roundings = _bag_token_mass(layer, activations, backprops.shape[0])
    bounds = _count_identity_bound(backprops, token_mass, roundings)
    return {layer.weight: rounded_up(bounds, norm_dtype(backprops))}


@register_clipped_sum(nn.EmbeddingBag)
def embedding_bag_clipped_sum(
    layer: nn.EmbeddingBag, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``{weight: sum_i w_i grad_i}`` (``[V, D]``): each token adds ``w_bag u_t g_bag``."""
    if layer.weight not in weights:
        return {}
    ids, u, bags = _bag_tokens(layer, activations, backprops.shape[0])
    g = backprops.to(norm_dtype(backprops))
    coeff = u.to(g.dtype) * weights[layer.weight].to(g.dtype)[bags]
    return {layer.weight: _row_sums(ids, g[bags] * coeff.unsqueeze(1), layer.num_embeddings)}


@register_cross_term(nn.Embedding, nn.Linear)
def embedding_linear_cross_term(
    embedding: nn.Embedding, embedding_use: Use, head: nn.Linear, head_use: Use
) -> dict[nn.Parameter, Tensor]:
    """``{shared weight: [B]}``: upper bounds of each sample's ``<E_i, H_i>`` (module docstring).

    Args:
        embedding_use: ``([token ids [B, *]], output gradients [B, *, D])``.
        head_use: ``([inputs [B, *, D]], output gradients [B, *, V])``.

    In float64, plus the worst-case round-off ``2 (gamma_D + gamma_{ST+1}) M_i`` with
    ``M_i = sum_{s,t} |G_i[s, x_t]| ||A_i[s]|| ||e_t||`` (each ``<e_t, A_i[s]>`` errs by at most
    ``gamma_D ||e_t|| ||A_i[s]||``, the products' sum by ``gamma_{ST+1}`` of their magnitudes; the
    factor 2 covers second-order terms), rounded up: the norms stay upper bounds.
    """
    weight = embedding.weight
    if head.weight is not weight or not weight.requires_grad:
        return {}
    _check_embedding(embedding)
    (tokens, *_), embedding_grads = embedding_use
    (head_inputs, *_), head_grads = head_use
    ids = tokens.reshape(tokens.shape[0], -1)  # [B, T]
    e = embedding_grads.reshape(*ids.shape, -1).double()  # [B, T, D]
    if embedding.padding_idx is not None:  # padding positions give the embedding no gradient
        e = e * (ids != embedding.padding_idx).unsqueeze(-1).to(e.dtype)
    a, g = as_sequence(head_inputs).double(), as_sequence(head_grads)  # [B, S, D], [B, S, V]
    inner = torch.bmm(a, e.transpose(1, 2))  # [B, S, T]: <A_i[s], e_t>
    # G_i[s, x_t], [B, S, T]: gathered before the (exact) float64 cast, not a [B, S, V] float64 copy
    picked = g.gather(2, ids.unsqueeze(1).expand(-1, g.shape[1], -1)).double()
    value = (inner * picked).sum(dim=(1, 2))
    lengths = torch.linalg.vector_norm(a, dim=2).unsqueeze(2) * torch.linalg.vector_norm(e, dim=2).unsqueeze(1)
    magnitude = (picked.abs() * lengths).sum(dim=(1, 2))  # M_i
    slack = 2 * (float64_roundoff(e.shape[2]) + float64_roundoff(inner.shape[1] * inner.shape[2] + 1))
    return {weight: rounded_up(value + slack * magnitude, norm_dtype(head_grads))}
