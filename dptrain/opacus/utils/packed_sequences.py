"""Opacus's ``opacus.utils.packed_sequences``: the sequence lengths of a PackedSequence (used
with DPLSTM and packed batches), and the random packed batches Opacus's DP-RNN tests use."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence


def compute_seq_lengths(batch_sizes: torch.Tensor) -> list[int]:
    """The lengths of the sequences of a PackedSequence, longest first, from its `batch_sizes`
    ([T]: how many sequences are still running at each time step t): sequence i (in that order)
    runs at every step where more than i sequences run."""
    return [int((batch_sizes > i).sum()) for i in range(int(batch_sizes[0]))]


def _gen_packed_data(minibatch_size: int, max_seq_length: int, input_dim: int,
                     batch_first: bool, sorted_: bool | None = False) -> PackedSequence:
    """Test data: `minibatch_size` sequences of random lengths in [1, max_seq_length] and
    standard normal features [length, input_dim], zero-padded to [B, T, D] (batch_first) or
    [T, B, D] and packed; `sorted_`: given longest first (enforce_sorted=True) rather than in
    random order."""
    lengths = torch.randint(1, max_seq_length + 1, (minibatch_size,))
    if sorted_:
        lengths = lengths.sort(descending=True).values
    padded = torch.zeros(minibatch_size, int(lengths.max()), input_dim)
    for i, length in enumerate(lengths.tolist()):
        padded[i, :length] = torch.randn(length, input_dim)
    if not batch_first:
        padded = padded.transpose(0, 1)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first,
                                enforce_sorted=bool(sorted_))


__all__ = ["compute_seq_lengths"]
