"""Rank sharding of any index stream (dptrain/data/sharding.py): one rule for every selection.

Ranks are simulated in one process (rank r of W passed or patched in: the collectives are no-ops
without a process group); tests/distributed/ runs the same through spawned gloo ranks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data import sharding
from dptrain.data.cyclic_sampling import (
    CyclicPoissonBatchSampler,
    DistributedCyclicPoissonBatchSampler,
    DistributedCyclicPoissonDataLoader,
    partition,
)
from dptrain.data.distributed import (
    DistributedDPDataLoader,
    DistributedPoissonBatchSampler,
)
from dptrain.data.sampling import DPDataLoader, PoissonBatchSampler, ShuffleBatchSampler
from dptrain.data.sharding import RankSharded, RankShare, shard_sampler
from dptrain.data.user_sampling import UserPoissonBatchSampler
from dptrain.errors import ConfigError
from dptrain.privacy.selection import LoaderContext, Selection
from dptrain.privacy.selection.balls_in_bins import BallsInBinsBatchSampler
from dptrain.randomness import uniform

N, EPOCHS = 37, 2   # 37: no W in {2, 3} divides it (shares of unequal sizes)

#: (kind, q, groups, rate schedule): every registered scheme that draws its own batches
SCHEMES = {
    "poisson": ("poisson", 0.2, 1, None),
    "poisson_scheduled": ("poisson", 0.2, 1, lambda i: (0.1, 0.3, 0.2)[i % 3]),
    "cyclic_poisson": ("cyclic_poisson", 0.1, 3, None),
    "shuffle": ("shuffle", 0.2, 1, None),
    "balls_in_bins": ("balls_in_bins", 0.2, 1, None),
}


def _loader(scheme: str, distributed: bool, seed: int = 0) -> Any:
    """The scheme's private loader over range(N), as its selection strategy builds it."""
    kind, q, groups, schedule = SCHEMES[scheme]
    context = LoaderContext(generator=torch.Generator().manual_seed(seed), rate_schedule=schedule,
                            distributed=distributed)
    data = DataLoader(TensorDataset(torch.arange(N)), batch_size=round(q * N))
    return Selection(q, kind=kind, groups=groups).private_loader(data, context)


def _batches(loader: Any) -> list[list[int]]:
    return [x.tolist() for _ in range(EPOCHS) for (x,) in loader]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_the_union_of_the_rank_shares_is_the_one_process_batch_with_the_same_generator(
        scheme, world, monkeypatch):
    single = _batches(_loader(scheme, distributed=False))
    shares = []
    for rank in range(world):
        monkeypatch.setattr(sharding, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(sharding, "get_world_size", lambda group=None: world)
        loader = _loader(scheme, distributed=True)
        assert loader.batch_sampler.rank_share == RankShare(rank, world)
        shares.append(_batches(loader))
    assert all(len(s) == len(single) for s in shares)
    for step, batch in enumerate(single):
        parts = [shares[r][step] for r in range(world)]
        assert all(i % world == r for r, part in enumerate(parts) for i in part)
        assert sorted(i for part in parts for i in part) == batch   # disjoint, bit-identical


# -- secure mode: each rank its own CSPRNG, its own examples' draws ------------------------------
def _secure(scheme: str) -> Any:
    """A fresh secure sampler of `scheme` over range(N) (cyclic: a partition fixed by its seed,
    as rank 0's broadcast seed fixes it on every rank)."""
    _, q, groups, _ = SCHEMES[scheme]
    if scheme == "poisson":
        return PoissonBatchSampler(N, q, secure=True)
    if scheme == "cyclic_poisson":
        return CyclicPoissonBatchSampler(N, q, groups, secure=True, partition_seed=7)
    return BallsInBinsBatchSampler(N, q, secure=True)


PER_EXAMPLE = ["poisson", "cyclic_poisson", "balls_in_bins"]


@pytest.mark.parametrize("scheme", PER_EXAMPLE)
def test_secure_shares_are_disjoint_and_hold_only_the_ranks_examples_at_the_scheme_rate(scheme):
    world, epochs = 3, 300
    ranks = [shard_sampler(_secure(scheme), rank=r, world_size=world) for r in range(world)]
    steps = ranks[0].steps
    counts = torch.zeros(steps * epochs, N)            # [step, example]: 1 when in the batch
    for rank, sampler in enumerate(ranks):
        for epoch in range(epochs):
            for position, batch in enumerate(sampler):
                assert all(i % world == rank for i in batch)
                counts[epoch * steps + position, batch] += 1
    assert counts.max() == 1                           # disjoint shares
    total = counts.shape[0]
    if scheme == "poisson":            # each example in each batch with probability q
        rate, q = counts.mean(0), ranks[0].sample_rate
        assert ((rate - q).abs() < 6 * math.sqrt(q * (1 - q) / total)).all()
    elif scheme == "cyclic_poisson":   # only at its group's steps, there with probability b q
        group = partition(N, ranks[0].groups, 7)
        turn = torch.arange(total) % ranks[0].groups           # the group of each step
        mine = turn[:, None] == group[None, :]                  # [step, example]
        assert counts[~mine].sum() == 0
        p, at = ranks[0].group_rate, mine.sum(0)
        rate = (counts * mine).sum(0) / at
        assert ((rate - p).abs() < 6 * torch.sqrt(p * (1 - p) / at)).all()
    else:                              # one batch an epoch, each of the k batches equally likely
        per_epoch = counts.view(epochs, steps, N)
        assert (per_epoch.sum(1) == 1).all()
        p = 1 / steps
        rate = per_epoch.mean(0)                                # [bin, example]
        assert ((rate - p).abs() < 6 * math.sqrt(p * (1 - p) / epochs)).all()


@pytest.mark.parametrize("scheme", PER_EXAMPLE)
def test_a_secure_rank_draws_only_its_own_examples_uniforms(scheme, monkeypatch):
    """N / W draws a rank per batch (per epoch for balls-in-bins), not N: the cost of secure
    Poisson sampling over W ranks stays what one rank's shard needs."""
    drawn: list[int] = []

    def counting(numel: int, generator: Any, secure: bool) -> torch.Tensor:
        drawn.append(numel)
        return uniform(numel, generator, secure)

    for module in ("dptrain.data.sampling", "dptrain.data.cyclic_sampling",
                   "dptrain.privacy.selection.balls_in_bins"):
        monkeypatch.setattr(f"{module}.uniform", counting)
    world, rank = 3, 1
    sampler = shard_sampler(_secure(scheme), rank=rank, world_size=world)
    batches = list(sampler)
    own = RankShare(rank, world).indices(N)
    if scheme == "cyclic_poisson":   # the rank's members of each step's group
        group = partition(N, sampler.groups, 7)
        assert drawn == [int((group[own] == s % sampler.groups).sum()) for s in range(len(batches))]
    elif scheme == "poisson":
        assert drawn == [len(own)] * len(batches)
    else:
        assert drawn == [len(own)]


def test_secure_sharding_of_a_stream_not_drawn_per_example_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="secure_mode.*shuffle.*secure_mode=False"):
        shard_sampler(ShuffleBatchSampler(N, 0.2, secure=True), rank=0, world_size=2)
    users = UserPoissonBatchSampler([torch.tensor([i]) for i in range(N)], 0.2, secure=True)
    with pytest.raises(ConfigError, match="secure_mode"):
        shard_sampler(users, rank=0, world_size=2)
    shard_sampler(ShuffleBatchSampler(N, 0.2, secure=True), rank=0, world_size=1)  # one rank: ok


def test_the_ranks_compare_the_presence_of_a_sample_rate_schedule(monkeypatch):
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(sharding, "check_same_on_every_rank",
                        lambda values, *args, **kwargs: seen.append(dict(values)))
    shard_sampler(PoissonBatchSampler(N, 0.2, sample_rate_schedule=lambda i: 0.2), 0, 2)
    assert seen[0]["sample_rate_schedule"] is True


# -- the public Distributed* names: constructors over the one rule -------------------------------
def test_the_distributed_samplers_are_the_generic_wrapper_not_a_copy_of_the_rule():
    poisson = DistributedPoissonBatchSampler(N, 0.3, rank=1, world_size=3,
                                             generator=torch.Generator().manual_seed(2))
    cyclic = DistributedCyclicPoissonBatchSampler(N, 0.1, 3, rank=2, world_size=3,
                                                  generator=torch.Generator().manual_seed(2))
    for sampler, cls, base in [(poisson, DistributedPoissonBatchSampler, PoissonBatchSampler),
                               (cyclic, DistributedCyclicPoissonBatchSampler,
                                CyclicPoissonBatchSampler)]:
        assert isinstance(sampler, base) and isinstance(sampler, RankSharded)
        assert not {"draw", "draw_batch", "__iter__"} & set(vars(cls))
        assert sampler.rank_share == RankShare(sampler.rank, sampler.world_size)
        assert sampler.shard.tolist() == list(range(sampler.rank, N, 3))
        assert all(i % 3 == sampler.rank for i in sampler.draw())
    data = TensorDataset(torch.arange(N))
    loader = DistributedDPDataLoader(data, 0.3, rank=0, world_size=2)
    assert isinstance(loader, DPDataLoader)
    assert isinstance(loader.batch_sampler, DistributedPoissonBatchSampler)
    cyclic_loader = DistributedCyclicPoissonDataLoader(data, 0.1, groups=3, rank=0, world_size=2)
    assert isinstance(cyclic_loader.batch_sampler, DistributedCyclicPoissonBatchSampler)


def test_a_one_process_sampler_draws_the_same_batches_as_before_sharding_existed():
    """The per-example draw over draws_for(range(N)) is the old draw over all N uniforms."""
    sampler = PoissonBatchSampler(N, 0.3, steps=5, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    expected = [(torch.rand(N, generator=gen, dtype=torch.float64) < 0.3).nonzero().flatten()
                .tolist() for _ in range(5)]
    assert list(sampler) == expected
