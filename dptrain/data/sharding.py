"""Sharding any index stream over ranks: every rank draws a global batch and keeps the indices
i with i % W == rank (rank-strided shares, sizes within one).

* Generator mode (the default and the reproducible opt-in): every rank holds the same generator
  state (rank 0's, broadcast), so every rank draws the same global batch and the union of the
  shares is the batch one process would draw: the selection's accounting holds unchanged.
* Secure mode: each rank draws from its own OS CSPRNG, and keeps only the examples it owns. Each
  example's part in the batches is then decided by one draw of one rank, made exactly as one
  process would make it for that example, independently of every other example's: for a
  selection whose draws are per example (each example's own coin, or its own uniformly drawn
  batch of the epoch: Poisson, balls-in-bins) the union is a draw of the same distribution.

The clipped sums are all-reduced (DDP) or reduce-scattered (FSDP2) and noised once. Poisson and
cyclic Poisson sampling keep their own rank-sharded samplers for now (dptrain.data.distributed,
dptrain.data.cyclic_sampling: the same rule, written before this wrapper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dptrain.data.distributed import check_same_sampling, check_shard
from dptrain.distributed.runtime import get_rank, get_world_size, sync_generator


@dataclass(frozen=True)
class RankShare:
    """Rank `rank` of `world_size`: its share of a batch of indices."""

    rank: int
    world_size: int

    def keep(self, batch: list[int]) -> list[int]:
        """The indices of `batch` this rank trains on (i % world_size == rank, order kept)."""
        return [i for i in batch if i % self.world_size == self.rank]


def shard_sampler(sampler: Any, rank: int | None = None, world_size: int | None = None,
                  group: Any = None) -> Any:
    """Make `sampler` (any dptrain batch sampler drawing from `sampler.generator`) yield this
    rank's share of every batch. A collective outside one process: the ranks check that they
    sample alike and, outside secure mode, take rank 0's generator state (see the module
    docstring for secure mode: only for selections whose draws are per example)."""
    rank = get_rank(group) if rank is None else rank
    world_size = get_world_size(group) if world_size is None else world_size
    if world_size == 1:
        return sampler
    check_shard(sampler.num_samples, rank, world_size)
    check_same_sampling(sampler.num_samples, sampler.sample_rate, sampler.steps, sampler.secure,
                        False, group=group, reproducible=sampler.reproducible)
    if not sampler.secure:
        sync_generator(sampler.generator, group=group)
    sampler.rank_share = RankShare(rank, world_size)
    return sampler


__all__ = ["RankShare", "shard_sampler"]
