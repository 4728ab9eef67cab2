"""Accumulation of per-sample quantities (grad samples, squared norms) over forward passes.

Which rows a forward pass fills (:class:`BackwardRows`): forward calls of the wrapped model whose
outputs feed ONE backward hold the same examples (two augmented views of a batch, the two sides of
a contrastive loss), so they share one block of rows and their gradients SUM per example before
clipping. Forward passes reached by separate backwards (gradient accumulation, the physical chunks
of a virtual batch) hold different examples and get separate blocks, CONCATENATED along dim 0 in
forward order. Anything in between is refused with :class:`~dptrain.errors.UnsupportedModuleError`
rather than guessed (summing different examples, or clipping one example's views separately, would
both break the sensitivity the accountant assumes):

- one backward reaching passes of different batch sizes;
- a backward reaching a pass that an earlier backward left out although the pass was run before it
  (two views backpropagated separately look exactly like that);
- one backward reaching both rows an earlier backward already formed and other passes.

A backward that reaches only passes of one earlier block (``retain_graph=True`` and a second loss
reaching layer calls the first did not: a layer call's inputs are freed by its first backward)
adds into that block. Within a block the uses of a layer SUM as well (shared weights, a recurrent
layer's T steps). :class:`PerPassStore` holds any keyed tensors of shape ``[B_block, *shape]`` that
way; the ghost-clipping module keys its ``[B]`` norms and its stored layer inputs by block too.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.batch import PassBatch


@dataclass
class SampleRows:
    """One block of examples: the rows that the passes of one backward fill together.

    Attributes:
        id: its key in the stores: the id of its first pass (so blocks sort in forward order).
        batch_size: B of every pass in the block.
        backward: the index (:attr:`BackwardRows.completed`) of the backward that formed it.
    """

    id: int
    batch_size: int
    backward: int


@dataclass
class ForwardPass:
    """One call of the wrapped model's forward (through the wrapper or the model itself).

    Attributes:
        id: increasing in forward order.
        batch: its batch size, read from the call's arguments (:mod:`dptrain.grad_sample.batch`).
        backwards_before: :attr:`BackwardRows.completed` when it started.
        uses: per-layer records of this pass (``{id(layer): UseGroup}``, owned by the module).
        rows: the block it fills, set by the first backward that reaches it.
    """

    id: int
    batch: PassBatch
    backwards_before: int
    uses: dict[int, Any] = field(default_factory=dict)
    rows: Optional[SampleRows] = None


_SAME_EXAMPLES = (
    "Forward calls whose outputs feed one backward are taken to be the same examples (e.g. two "
    "augmented views of a batch, or the two sides of a contrastive loss: their gradients are summed "
    "per example and clipped once), and separate backwards to be separate batches (gradient "
    "accumulation: their rows are concatenated)."
)
_MIXED = (
    "one backward reached forward calls whose gradients an earlier backward already captured, "
    "together with other forward calls"
)
_FIX = (
    "Fix: for several views of the same examples, run them all and call backward once on the sum "
    "of their losses; for gradient accumulation, call backward on each batch before the next "
    "batch's forward."
)


class BackwardRows:
    """Assigns the forward passes reached by each backward to blocks of rows (the rule above).

    The module calls :meth:`rows_of` for every layer call a backward reaches, and
    :meth:`end_backward` once the backward is over (also when it raised).
    """

    def __init__(self) -> None:
        self.completed = 0  # backwards that formed a block
        self._current: Optional[SampleRows] = None  # the block of the running backward

    def rows_of(self, forward_pass: ForwardPass) -> SampleRows:
        """The block of ``forward_pass``, reached by the running backward; raise if ambiguous."""
        rows, current = forward_pass.rows, self._current
        if rows is None:
            rows = self._join_new(forward_pass, current)
        elif current is not None and current is not rows:
            self._refuse(_MIXED)
        self._current = rows
        return rows

    def _join_new(self, forward_pass: ForwardPass, current: Optional[SampleRows]) -> SampleRows:
        """The block of a pass no backward had reached: the running backward's (new) block."""
        batch = forward_pass.batch.size or 0
        if forward_pass.backwards_before != self.completed:
            self._refuse(
                "a backward reached a forward call that an earlier backward left out although the "
                "call was made before it (two views of the same examples backpropagated "
                "separately would each be clipped as a different example)"
            )
        if current is None:
            current = SampleRows(forward_pass.id, batch, self.completed)
        elif current.backward != self.completed:
            self._refuse(_MIXED)
        elif current.batch_size != batch:
            self._refuse(
                f"one backward reached forward calls with different batch sizes ({current.batch_size} "
                f"and {batch} examples), which cannot be the same examples"
            )
        forward_pass.rows = current
        return current

    def end_backward(self) -> None:
        """Close the running backward (count it if it formed a block)."""
        if self._current is not None and self._current.backward == self.completed:
            self.completed += 1
        self._current = None

    @staticmethod
    def _refuse(what: str) -> None:
        raise UnsupportedModuleError(
            f"Ambiguous per-sample gradients: {what}. {_SAME_EXAMPLES} Anything else is refused "
            f"rather than guessed, since summing different examples or clipping one example "
            f"several times would both exceed the clipping bound the accountant assumes. {_FIX}"
        )


@dataclass
class _Chunk:
    """One block's rows of one key; ``owned`` means we allocated it and may add into it in place."""

    value: Tensor
    owned: bool


class PerPassStore:
    """Keyed per-sample tensors, summed within a block of rows and concatenated across blocks.

    A block is identified by an int (:attr:`SampleRows.id`; the tests use any ints), blocks are
    ordered by it. :meth:`materialize` returns, per key, one tensor ``[sum of block batch sizes,
    *shape]`` with zero rows for blocks the key missed (a layer unused there has zero gradient for
    those samples).
    """

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}
        self._chunks: dict[Hashable, dict[int, _Chunk]] = {}

    def add(self, key: Hashable, block: int, value: Tensor) -> None:
        """Add ``value`` (``[B_block, *shape]``) to ``key``'s rows of block ``block``.

        ``value`` is never modified later (it may alias a tensor autograd still uses).
        """
        batch = value.shape[0]
        known = self._blocks.setdefault(block, batch)
        if known != batch:
            raise RuntimeError(f"block {block} has batch size {known}, got a value of {batch} rows")
        chunks = self._chunks.setdefault(key, {})
        chunk = chunks.get(block)
        if chunk is None:
            chunks[block] = _Chunk(value, owned=False)
        elif chunk.owned:
            chunk.value.add_(value)
        else:
            chunks[block] = _Chunk(chunk.value + value, owned=True)

    def materialize(self) -> dict[Hashable, Tensor]:
        """Return ``{key: Tensor[B_total, *shape]}`` (contiguous) and keep views of it as chunks."""
        result = {}
        for key, chunks in self._chunks.items():
            parts = [self._part(chunks, block, batch) for block, batch in self._ordered_blocks()]
            full = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)
            result[key] = full
            self._chunks[key] = self._as_views(full)
        return result

    def _ordered_blocks(self) -> list[tuple[int, int]]:
        """``(block, batch_size)`` in increasing block id."""
        return sorted(self._blocks.items())

    def _part(self, chunks: dict[int, _Chunk], block: int, batch: int) -> Tensor:
        """The rows of one block, zeros when the key got nothing in that block."""
        if block in chunks:
            return chunks[block].value
        like = next(iter(chunks.values())).value
        return like.new_zeros((batch, *like.shape[1:]))

    def _as_views(self, full: Tensor) -> dict[int, _Chunk]:
        """Split a materialized tensor back into per-block views (not owned: added out of place)."""
        blocks = self._ordered_blocks()
        if len(blocks) == 1:  # the usual case: the block is the whole tensor (no view to make)
            return {blocks[0][0]: _Chunk(full, owned=False)}
        views, start = {}, 0
        for block, batch in blocks:
            views[block] = _Chunk(full[start : start + batch], owned=False)
            start += batch
        return views

    def batch_size(self) -> int:
        """Total number of samples over all blocks seen since the last reset."""
        return sum(self._blocks.values())

    def keys(self) -> Iterable[Hashable]:
        """Keys holding at least one block."""
        return self._chunks.keys()

    def discard(self, key: Hashable) -> None:
        """Forget ``key``; forget the blocks too once no key is left."""
        self._chunks.pop(key, None)
        if not self._chunks:
            self._blocks.clear()

    def reset(self) -> None:
        """Forget everything."""
        self._chunks.clear()
        self._blocks.clear()
