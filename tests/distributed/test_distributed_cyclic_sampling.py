"""Cyclic Poisson sampling under DDP: every rank holds rank 0's partition (also in secure
mode, where each rank's coins are its own) and draws its shard of the group's batch."""

from __future__ import annotations

from typing import Any

import ddp_workers as workers
import pytest
import torch
from torch.utils.data import TensorDataset

from dptrain.data.cyclic_sampling import partition

GROUPS, RATE, STEPS = 3, 0.1, 6


def cyclic_worker(rank: int, world_size: int, port: int, secure: bool) -> dict[str, Any]:
    """A DistributedCyclicPoissonDataLoader over range(N) with default (OS entropy) or secure
    randomness: its partition seed and this rank's first STEPS batches."""
    from dptrain.data.cyclic_sampling import DistributedCyclicPoissonDataLoader

    workers.init_gloo(rank, world_size, port)
    loader = DistributedCyclicPoissonDataLoader(TensorDataset(torch.arange(workers.N)),
                                                sample_rate=RATE, groups=GROUPS, secure=secure)
    return {"seed": loader.batch_sampler.partition_seed,
            "batches": [b.tolist() for (b,), _ in zip(loader, range(STEPS))]}


@pytest.mark.parametrize("secure", [False, True])
def test_every_rank_holds_rank_0s_partition_and_draws_its_shard_of_the_groups_batch(
        secure, tmp_path):
    ranks = workers.run_ranks(cyclic_worker, tmp_path, args=(secure,))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    assert len({rank["seed"] for rank in ranks}) == 1
    group = partition(workers.N, GROUPS, ranks[0]["seed"])
    for r, rank in enumerate(ranks):
        for step, batch in enumerate(rank["batches"]):
            assert all(i % len(ranks) == r and int(group[i]) == step % GROUPS for i in batch)
