"""Sharding any index stream over ranks: every rank draws the same global batch from one shared
generator and keeps the indices i with i % W == rank (rank-strided shares, sizes within one).

The union over ranks is the batch one process would draw, so the selection's accounting holds
unchanged; the clipped sums are all-reduced (DDP) or reduce-scattered (FSDP2) and noised once.
It needs the generator in the same state on every rank (rank 0's, broadcast), which secure mode's
per-process CSPRNG cannot give: a selection that can draw per-rank coins securely (Poisson,
cyclic Poisson) keeps its own rank-sharded sampler (dptrain.data.distributed,
dptrain.data.cyclic_sampling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dptrain.data.distributed import check_same_sampling, check_shard
from dptrain.distributed.runtime import get_rank, get_world_size, sync_generator
from dptrain.errors import ConfigError


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
    sample alike and take rank 0's generator state. ConfigError in secure mode."""
    rank = get_rank(group) if rank is None else rank
    world_size = get_world_size(group) if world_size is None else world_size
    if world_size == 1:
        return sampler
    if sampler.secure:
        raise ConfigError("sharding a batch selection over processes needs one generator shared "
                          "by every rank; secure mode draws from each process's own CSPRNG. Set "
                          "privacy.secure_mode=false, or use privacy.sampling=poisson.")
    check_shard(sampler.num_samples, rank, world_size)
    check_same_sampling(sampler.num_samples, sampler.sample_rate, sampler.steps, sampler.secure,
                        False, group=group, reproducible=sampler.reproducible)
    sync_generator(sampler.generator, group=group)
    sampler.rank_share = RankShare(rank, world_size)
    return sampler


__all__ = ["RankShare", "shard_sampler"]
