"""Opacus's ``opacus.utils.batch_memory_manager``: dptrain's BatchMemoryManager (same keyword
arguments: data_loader, max_physical_batch_size, optimizer)."""

from dptrain.data.virtual import BatchMemoryManager

__all__ = ["BatchMemoryManager"]
