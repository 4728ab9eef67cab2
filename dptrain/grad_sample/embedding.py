"""Grad samplers for ``nn.Embedding`` and ``nn.EmbeddingBag``.

Sample b's gradient is a ``[V, D]`` matrix whose row v is the sum of the backprops at the
positions where sample b looks up token v (scaled by the bag weights for EmbeddingBag); we build
all B of them with one ``scatter_add``. Rows of ``padding_idx`` get no gradient, as in torch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.registry import register_grad_sampler


def _check_embedding(layer: nn.Embedding | nn.EmbeddingBag) -> None:
    """Reject options whose gradient mixes samples or whose forward rewrites the weight."""
    kind = type(layer).__name__
    if layer.max_norm is not None:
        raise UnsupportedModuleError(
            f"{kind}(max_norm={layer.max_norm}) renormalises its weight in place during forward, "
            f"so per-sample gradients are not defined; construct it with max_norm=None."
        )
    if layer.scale_grad_by_freq:
        raise UnsupportedModuleError(
            f"{kind}(scale_grad_by_freq=True) scales gradients by token counts over the whole "
            f"batch, which mixes samples; construct it with scale_grad_by_freq=False."
        )


def scatter_rows(indices: Tensor, values: Tensor, num_rows: int, padding_idx: Optional[int]) -> Tensor:
    """Per-sample sums of ``values`` into the rows named by ``indices``.

    Args:
        indices: ``[B, N]`` row indices (long).
        values: ``[B, N, D]`` the contribution of each position.
        num_rows: V, the number of rows of the weight.
        padding_idx: a row that receives no gradient, or None.

    Returns:
        ``[B, V, D]``.
    """
    batch, _, dim = values.shape
    out = values.new_zeros(batch, num_rows, dim)
    out.scatter_add_(1, indices.unsqueeze(-1).expand(-1, -1, dim), values)
    if padding_idx is not None:
        out[:, padding_idx] = 0
    return out


@register_grad_sampler(nn.Embedding)
def embedding_grad_sample(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of an Embedding.

    Args:
        activations: ``[idx]`` with idx ``[B, *]`` (long).
        backprops: ``[B, *, D]``.

    Returns:
        weight: ``[B, num_embeddings, D]``.
    """
    _check_embedding(layer)
    batch = backprops.shape[0]
    indices = activations[0].reshape(batch, -1)
    values = backprops.reshape(batch, -1, layer.embedding_dim)
    return {layer.weight: scatter_rows(indices, values, layer.num_embeddings, layer.padding_idx)}


def _bags(layer: nn.EmbeddingBag, activations: list[Tensor], batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flatten the EmbeddingBag inputs into (indices [M], bag id [M], weight [M]) per position.

    ``activations`` are ``forward``'s positional inputs: ``input`` ([B, N], or [M] with
    ``offsets`` [B] / [B + 1] with include_last_offset) and optionally ``per_sample_weights``.
    """
    indices = activations[0]
    offsets = activations[1] if len(activations) > 1 else None
    weights = activations[2] if len(activations) > 2 else None
    if indices.dim() == 2:
        bag = torch.arange(batch, device=indices.device).repeat_interleave(indices.shape[1])
        indices = indices.reshape(-1)
        weights = weights.reshape(-1) if weights is not None else None
    else:
        # position i belongs to the last bag starting at or before i (empty bags own nothing,
        # including a last bag whose offset equals len(input))
        starts = offsets[:batch]
        positions = torch.arange(indices.shape[0], device=indices.device)
        bag = torch.searchsorted(starts, positions, right=True) - 1
    scale = torch.ones(indices.shape, dtype=torch.float64, device=indices.device) if weights is None else weights
    keep = torch.ones_like(indices, dtype=torch.bool) if layer.padding_idx is None else indices != layer.padding_idx
    scale = scale * keep
    if layer.mode == "mean":
        counts = torch.zeros(batch, dtype=scale.dtype, device=scale.device).index_add_(0, bag, keep.to(scale.dtype))
        scale = scale / counts.clamp(min=1)[bag]
    return indices, bag, scale


@register_grad_sampler(nn.EmbeddingBag)
def embedding_bag_grad_sample(
    layer: nn.EmbeddingBag, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of an EmbeddingBag (mode "sum" or "mean"), one bag per sample.

    Args:
        activations: ``[input, offsets?, per_sample_weights?]`` as passed to forward.
        backprops: ``[B, D]``.

    Returns:
        weight: ``[B, num_embeddings, D]``.
    """
    _check_embedding(layer)
    if layer.mode not in ("sum", "mean"):
        raise UnsupportedModuleError(
            f"EmbeddingBag(mode={layer.mode!r}) has no per-sample gradient sampler; use mode='sum' "
            f"or mode='mean'."
        )
    batch, dim = backprops.shape
    indices, bag, scale = _bags(layer, activations, batch)
    out = backprops.new_zeros(batch, layer.num_embeddings, dim)
    values = backprops[bag] * scale.to(backprops.dtype).unsqueeze(-1)  # [M, D]
    out.index_put_((bag, indices), values, accumulate=True)
    return {layer.weight: out}
