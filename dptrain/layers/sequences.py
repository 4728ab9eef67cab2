"""Sequence layout helpers for the DP recurrent layers: padding, packing, per-sample reversal.

Inside a DP recurrent layer a batch is always a padded tensor in the layer's own layout
(``[B, T, D]`` if ``batch_first`` else ``[T, B, D]``) plus per-sample lengths ``[B]`` (int64, on
the tensor's device). PackedSequence inputs are unpacked to that form in the original (unsorted)
batch order, and outputs are packed back with exactly the input's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence


@dataclass(frozen=True)
class PaddedBatch:
    """A padded batch with its per-sample lengths.

    Attributes:
        data: ``[B, T, D]`` (batch_first) or ``[T, B, D]``.
        lengths: ``[B]`` int64, each in ``[1, T]``; all ``T`` for a plain tensor input.
        batch_first: layout of ``data``.
        packed: the PackedSequence it came from (its layout is reused for the output), or None.
    """

    data: torch.Tensor
    lengths: torch.Tensor
    batch_first: bool
    packed: PackedSequence | None = None

    @property
    def time_dim(self) -> int:
        return 1 if self.batch_first else 0

    @property
    def batch_dim(self) -> int:
        return 0 if self.batch_first else 1

    @property
    def is_full_length(self) -> bool:
        """True for a plain tensor input: every sample has the padded length T (no masking)."""
        return self.packed is None


def to_padded(x: torch.Tensor | PackedSequence, batch_first: bool) -> PaddedBatch:
    """Unpack (if needed) into a :class:`PaddedBatch` in the original batch order."""
    if isinstance(x, PackedSequence):
        data, lengths = pad_packed_sequence(x, batch_first=batch_first)
        return PaddedBatch(data, lengths.to(data.device), batch_first, packed=x)
    time_dim = 1 if batch_first else 0
    batch = x.shape[1 - time_dim]
    lengths = torch.full((batch,), x.shape[time_dim], dtype=torch.long, device=x.device)
    return PaddedBatch(x, lengths, batch_first)


def like_input(output: torch.Tensor, batch: PaddedBatch) -> torch.Tensor | PackedSequence:
    """Return ``output`` (padded, same layout as ``batch.data``) in the input's form.

    For a packed input the result is a PackedSequence with the input's ``batch_sizes``,
    ``sorted_indices`` and ``unsorted_indices``, as ``torch.nn.LSTM`` returns it.
    """
    if batch.packed is None:
        return output
    packed = batch.packed
    order = packed.sorted_indices
    if order is not None:
        output = output.index_select(batch.batch_dim, order)
        lengths = batch.lengths.index_select(0, order)
    else:
        lengths = batch.lengths
    repacked = pack_padded_sequence(output, lengths.cpu(), batch_first=batch.batch_first)
    return PackedSequence(
        repacked.data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
    )


def step_mask(batch: PaddedBatch) -> torch.Tensor:
    """``[T, B, 1]`` bool: True where time step t is inside sample b's sequence."""
    steps = torch.arange(batch.data.shape[batch.time_dim], device=batch.data.device)
    return (steps[:, None] < batch.lengths[None, :]).unsqueeze(-1)


def reverse_each(x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    """Reverse every sample's sequence within its own length; padding stays in place.

    ``x`` has ``batch``'s layout (any feature size). The map is its own inverse, so the same call
    turns the outputs of a reversed pass back into the original time order.
    """
    if batch.is_full_length:
        return x.flip(batch.time_dim)
    steps = torch.arange(x.shape[batch.time_dim], device=x.device)[:, None]  # [T, 1]
    lengths = batch.lengths[None, :]  # [1, B]
    source = torch.where(steps < lengths, lengths - 1 - steps, steps)  # [T, B]
    if batch.batch_first:
        source = source.t()
    index = source.unsqueeze(-1).expand_as(x)
    return x.gather(batch.time_dim, index)
