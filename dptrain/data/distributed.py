"""Distributed Poisson sampling: each rank yields its rank-strided share of one Poisson batch.

The rule (rank r keeps the sampled i with i % W == r; generator mode: one generator state on
every rank, so the union over ranks is the batch one process would draw; secure mode: each rank
draws its own examples' coins from its own CSPRNG) lives in `dptrain.data.sharding`, for every
selection scheme. The names here are constructors over it, kept for callers (dptrain.data,
dptrain.distributed, the Opacus namespace): `DistributedPoissonBatchSampler` is a
`PoissonBatchSampler` sharded when built, `DistributedDPDataLoader` a `DPDataLoader` over one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dptrain.data.sampling import DPDataLoader, PoissonBatchSampler
from dptrain.data.sharding import (  # noqa: F401  (check_*: their old home, still importable)
    RankSharded,
    check_same_sampling,
    check_shard,
    shard_sampler,
    warn_distributed_sampler,
)


class DistributedPoissonBatchSampler(RankSharded, PoissonBatchSampler):
    """This rank's part of each Poisson batch: the sampled indices i with i % W == rank.

    Args:
        num_samples: N, the size of the WHOLE dataset (every rank holds the full dataset).
        sample_rate: q, each example's inclusion probability per logical batch.
        rank, world_size, group: this process, the number of processes and their process group
            (default: from the process group; 0 and 1 without one).
        steps, generator, secure, sample_rate_schedule: as `PoissonBatchSampler`.

    Building it is a collective over several processes (`shard_sampler`: the ranks check that
    they sample alike and, outside secure mode, take rank 0's generator state). `len(sampler)`
    (logical steps per epoch) is the same on every rank, so ranks stay in step; `shard` is this
    rank's examples, LongTensor [N_r].
    """

    def __init__(self, num_samples: int, sample_rate: float, *, rank: int | None = None,
                 world_size: int | None = None, group: Any = None, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None) -> None:
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator,
                         secure=secure, sample_rate_schedule=sample_rate_schedule)
        shard_sampler(self, rank, world_size, group)


class DistributedDPDataLoader(DPDataLoader):
    """A DPDataLoader whose batch sampler is a `DistributedPoissonBatchSampler`.

    Each rank's loader yields that rank's shard of every logical batch; `sample_rate` is q of the
    whole dataset. `DistributedDPDataLoader.from_data_loader(loader)` (inherited) rebuilds a plain
    loader over the WHOLE dataset, reading `loader.batch_size` as the GLOBAL expected batch size:
    q = batch_size / N. Building it is a collective (every rank must build it, in the same
    order; see `dptrain.data.sharding.shard_sampler`).
    """

    def __init__(self, dataset: Dataset, sample_rate: float, *, rank: int | None = None,
                 world_size: int | None = None, group: Any = None, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **loader_kwargs: Any) -> None:
        sampler = DistributedPoissonBatchSampler(
            len(dataset), sample_rate, rank=rank, world_size=world_size, group=group, steps=steps,
            generator=generator, secure=secure, sample_rate_schedule=sample_rate_schedule)
        self._init_loader(dataset, sampler, collate_fn, loader_kwargs)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, **kwargs: Any) -> DPDataLoader:
        """As `DPDataLoader.from_data_loader`; warns when `data_loader` has a DistributedSampler
        (the usual DDP habit): it is ignored, and its batch_size is read as the GLOBAL one."""
        warn_distributed_sampler(data_loader)
        return super().from_data_loader(data_loader, **kwargs)
