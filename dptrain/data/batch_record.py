"""The batch record: what the selection drew for one logical batch, from sampler to accountant.

    sampler.draw_record() -> BatchRecord(index, sample_rate, indices, user_groups)
    loader: hands the batch to the loop, its record becomes `loader.last_record()`
    private_step(optimizer, batch, ..., record) -> optimizer.release(record) -> Charge
    accountant.step(charge)

A private loader's sampler makes one record per batch it draws, keeps it while the batch waits
in a DataLoader's prefetch queue, and publishes it when the batch reaches the training loop
(`last_record`). The step that releases the batch takes q, the expected batch size q * N and the
user positions of its rows from that record, and the accountant charges the step's `Charge`
(dptrain.privacy.charge), made from the record: q has no other channel between the draw and the
charge, whatever a loop skipped or a DataLoader drew ahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class BatchRecord:
    """One logical batch as the selection drew it.

    Attributes:
        index: the batch's place in the sampler's stream (0-based, counted over every epoch and
            every batch drawn, skipped ones included): batch `index` of the selection.
        sample_rate: q, with which the batch was drawn (the accountant's q for the step that
            releases it; a shuffle's or a random allocation's public 1 / steps).
        indices: the dataset rows of this rank's share of the batch, in the order drawn (None:
            the caller's own loader, whose sampler does not say).
        user_groups: at user level, the user position (0 .. U-1) of each collated row of the
            batch, int64 `Tensor[B]` (None at example level). Not compared by `==`.
    """

    index: int
    sample_rate: float
    indices: tuple[int, ...] | None = None
    user_groups: Tensor | None = field(default=None, compare=False)

    @property
    def size(self) -> int | None:
        """Rows of this rank's share (None when the indices are unknown)."""
        return None if self.indices is None else len(self.indices)


def last_record(loader: Any) -> BatchRecord | None:
    """The record of the batch `loader` most recently handed to the training loop: its
    `last_record()` (dptrain's private loaders and the caller's loader kept as shuffle passes);
    None for any other loader, or before its first batch."""
    read = getattr(loader, "last_record", None)
    return read() if callable(read) else None


__all__ = ["BatchRecord", "last_record"]
