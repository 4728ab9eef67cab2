"""Virtual batches: process a logical batch in physical chunks, stepping once at its end.

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64,
                            optimizer=optimizer) as physical_loader:
        for x, y in physical_loader:          # the user's loop is unchanged
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()                  # clip+accumulate only, except on a logical batch's last chunk

Each logical batch (e.g. a Poisson batch of any size) is split along dim 0 into chunks of at most
`max_physical_batch_size` rows (an `(x, y)` batch or a mapping batch such as `{input_ids,
attention_mask, labels}`, every tensor cut alike: `dptrain.batches`). Before yielding a chunk the manager tells the optimizer whether
the coming `step()` is a skipped one (`signal_skip_step`), so the noise is added once per logical
batch and the accountant is stepped once. An empty logical batch is yielded as one empty chunk
(its step still adds noise and is accounted). With a model fully sharded (FSDP) over two or more
ranks every rank gets as many chunks as the rank with the most (empty ones at the end): run the
forward and backward of every chunk, empty ones included, since FSDP's parameter gathers need
every rank (the module make_private returned runs an empty chunk on a placeholder row whose
gradient it discards, dptrain.distributed.fsdp). Memory: only one chunk's activations and
per-sample gradients exist at a time; the collated logical batch of inputs is held on the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from dptrain.batches import rows, slice_rows
from dptrain.errors import ConfigError


def split_batch(batch: Any, max_size: int) -> list[Any]:
    """Split a collated batch along dim 0 into ceil(B / max_size) chunks (one chunk if B <= max
    or B == 0)."""
    size = rows(batch)
    if size is None or size <= max_size:
        return [batch]
    count = math.ceil(size / max_size)
    return [slice_rows(batch, i * max_size, min(size, (i + 1) * max_size), size)
            for i in range(count)]


def pads_passes(optimizer: Any) -> bool:
    """Whether the ranks must run as many forward/backward passes per step, empty ones
    included: the optimizer of a model fully sharded over two or more ranks (its
    `passes_on_every_rank`; FSDP gathers parameters in every pass, collectives). With one
    process there is no other rank to keep in step: an empty chunk needs no pass."""
    return (getattr(optimizer, "passes_on_every_rank", None) is not None
            and getattr(optimizer, "world_size", 1) > 1)


def is_empty(chunk: Any) -> bool:
    """Whether `chunk` (a collated batch) has 0 rows."""
    return rows(chunk) == 0


def in_lockstep(chunks: list[Any], optimizer: Any) -> list[Any]:
    """`chunks`, followed by empty chunks up to the count of the rank with the most, when
    `pads_passes(optimizer)` (a collective); else `chunks` as is."""
    if not pads_passes(optimizer):
        return chunks
    empty = slice_rows(chunks[-1], 0, 0, rows(chunks[-1]) or 0)
    return chunks + [empty] * (optimizer.passes_on_every_rank(len(chunks)) - len(chunks))


class _PhysicalBatches:
    """Iterable over the physical chunks of `data_loader`'s logical batches."""

    def __init__(self, data_loader: Iterable[Any], max_size: int, optimizer: Any) -> None:
        self.data_loader = data_loader
        self.max_size = max_size
        self.optimizer = optimizer

    def __len__(self) -> int:
        """The number of logical batches (the number of real optimizer steps) per epoch."""
        return len(self.data_loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data_loader:
            chunks = in_lockstep(split_batch(batch, self.max_size), self.optimizer)
            for index, chunk in enumerate(chunks):
                self.optimizer.signal_skip_step(index < len(chunks) - 1)
                yield chunk


class BatchMemoryManager:
    """Context manager yielding an iterable of physical chunks (see the module docstring).

    Args:
        data_loader: the private loader (logical batches).
        max_physical_batch_size: the most rows per chunk (>= 1).
        optimizer: the DPOptimizer returned by make_private.
    """

    def __init__(self, *, data_loader: Iterable[Any], max_physical_batch_size: int,
                 optimizer: Any) -> None:
        if (isinstance(max_physical_batch_size, bool) or int(max_physical_batch_size)
                != max_physical_batch_size or max_physical_batch_size < 1):
            raise ConfigError(f"max_physical_batch_size={max_physical_batch_size!r} must be an "
                              "integer >= 1 (the most samples processed at once).")
        if not callable(getattr(optimizer, "signal_skip_step", None)):
            raise ConfigError(f"optimizer={type(optimizer).__name__} cannot skip steps: pass the "
                              "DPOptimizer returned by PrivacyEngine.make_private.")
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer

    def __enter__(self) -> _PhysicalBatches:
        return _PhysicalBatches(self.data_loader, self.max_physical_batch_size, self.optimizer)

    def __exit__(self, *exc_info: object) -> None:
        """Leaving mid-way through a logical batch discards its accumulated chunks (they were
        never released), so they cannot leak into the next logical batch's step."""
        discard = getattr(self.optimizer, "discard_partial_batch", None)
        if callable(discard):
            discard()
        else:
            self.optimizer.signal_skip_step(False)
