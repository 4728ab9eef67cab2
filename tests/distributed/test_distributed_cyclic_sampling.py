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


def cyclic_training_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """STEPS steps of a DDP model made private with cyclic Poisson sampling: this rank's
    parameters, its accountant's history and epsilon."""
    from torch import nn
    from torch.utils.data import DataLoader

    from dptrain.privacy.engine import PrivacyEngine

    workers.init_gloo(rank, world_size, port)
    model, data = workers.make_problem()
    model = nn.parallel.DistributedDataParallel(model)
    engine = PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=0.3,
        sampling="cyclic_poisson", sampling_groups=GROUPS)
    for (x, y), _ in zip(loader, range(STEPS)):
        optimizer.zero_grad()
        if len(x) > 0:
            nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    return {"params": torch.cat([p.detach().flatten() for p in module.parameters()]),
            "history": engine.accountant.history, "epsilon": engine.get_epsilon(1e-5)}


def test_ddp_training_with_cyclic_poisson_keeps_the_ranks_in_step_and_charges_the_rounds(
        tmp_path):
    from dptrain.accounting import compute_epsilon

    ranks = workers.run_ranks(cyclic_training_worker, tmp_path)
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    q = 4 / workers.N
    assert ranks[0]["history"] == ranks[1]["history"] == [(1.0, q, STEPS)]
    assert ranks[0]["epsilon"] == compute_epsilon([(1.0, GROUPS * q, STEPS // GROUPS)], 1e-5,
                                                  "rdp")
