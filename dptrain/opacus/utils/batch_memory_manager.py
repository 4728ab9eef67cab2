"""Opacus's ``opacus.utils.batch_memory_manager``: dptrain's BatchMemoryManager (same keyword
arguments: data_loader, max_physical_batch_size, optimizer), whose loader's ``len()`` counts
physical batches as Opacus's does (dptrain's own counts the logical batches, the real steps)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from dptrain.data import virtual
from dptrain.opacus._absent import absent


class _PhysicalBatches:
    """The physical chunks of dptrain's BatchMemoryManager, with Opacus's length: the logical
    batches times ceil-ed expected batch size / max_physical_batch_size."""

    def __init__(self, chunks: Any, optimizer: Any, max_size: int) -> None:
        self.chunks, self.optimizer, self.max_size = chunks, optimizer, max_size

    def __len__(self) -> int:
        return math.ceil(len(self.chunks) * self.optimizer.expected_batch_size / self.max_size)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.chunks)


class BatchMemoryManager(virtual.BatchMemoryManager):
    """dptrain's BatchMemoryManager; ``len()`` of what it yields is Opacus's physical count."""

    def __enter__(self) -> _PhysicalBatches:  # type: ignore[override]
        return _PhysicalBatches(super().__enter__(), self.optimizer, self.max_physical_batch_size)


_PHYSICAL = ("BatchMemoryManager(data_loader=..., max_physical_batch_size=..., optimizer=...) as "
             "a context manager: it yields the physical batches and skips the steps between them")
BatchSplittingSampler = absent("opacus.utils.batch_memory_manager.BatchSplittingSampler",
                               _PHYSICAL)
wrap_data_loader = absent("opacus.utils.batch_memory_manager.wrap_data_loader", _PHYSICAL)

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]
