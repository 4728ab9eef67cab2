"""DistributedPoissonBatchSampler: rank-strided shards whose union is one Poisson batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddp_workers as workers

from dptrain.data.sampling import PoissonBatchSampler
from dptrain.data.distributed import DistributedDPDataLoader, DistributedPoissonBatchSampler
from dptrain.errors import ConfigError


def _rank_samplers(n: int, q: float, world: int, seed: int, steps: int = 30, secure: bool = False):
    return [DistributedPoissonBatchSampler(n, q, rank=r, world_size=world, steps=steps,
                                           generator=torch.Generator().manual_seed(seed),
                                           secure=secure) for r in range(world)]


def test_union_over_ranks_is_the_single_process_poisson_batch_with_the_same_seed():
    single = list(PoissonBatchSampler(23, 0.3, steps=30, generator=torch.Generator().manual_seed(5)))
    per_rank = [list(s) for s in _rank_samplers(23, 0.3, world=3, seed=5)]
    unions = [sorted(i for rank in per_rank for i in rank[step]) for step in range(30)]
    assert unions == single


def test_each_rank_draws_only_its_rank_strided_shard():
    world = 3
    for rank, sampler in enumerate(_rank_samplers(23, 0.5, world=world, seed=1)):
        assert all(i % world == rank for batch in sampler for i in batch)


def test_secure_mode_ranks_stay_in_their_shards_and_include_each_example_with_rate_q():
    n, q, world, steps = 10, 0.3, 2, 3000
    counts = torch.zeros(n)
    for rank, sampler in enumerate(_rank_samplers(n, q, world, seed=0, steps=steps, secure=True)):
        for batch in sampler:
            assert all(i % world == rank for i in batch)
            counts[batch] += 1
    assert ((counts / steps - q).abs() < 6 * math.sqrt(q * (1 - q) / steps)).all()


def test_every_rank_runs_the_same_number_of_logical_steps():
    assert {len(s) for s in _rank_samplers(23, 0.1, world=4, seed=0, steps=17)} == {17}


def test_world_size_need_not_divide_the_dataset_size():
    shards = [s.shard.tolist() for s in _rank_samplers(7, 0.5, world=3, seed=0)]
    assert sorted(i for shard in shards for i in shard) == list(range(7))


def test_more_ranks_than_examples_is_a_config_error_naming_the_hardware_keys():
    with pytest.raises(ConfigError, match="hardware.nproc_per_node"):
        DistributedPoissonBatchSampler(3, 0.5, rank=0, world_size=4)


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_world_is_a_config_error(rank):
    with pytest.raises(ConfigError, match="rank"):
        DistributedPoissonBatchSampler(10, 0.5, rank=rank, world_size=2)


def test_the_loader_reads_the_plain_batch_size_as_the_global_expected_batch():
    data = TensorDataset(torch.arange(40.0).view(40, 1))
    loader = DistributedDPDataLoader.from_data_loader(DataLoader(data, batch_size=8))
    assert loader.sample_rate == pytest.approx(8 / 40)
    assert isinstance(loader.batch_sampler, DistributedPoissonBatchSampler)


def test_a_loader_with_a_distributed_sampler_warns_that_its_batch_size_is_read_as_global():
    data = TensorDataset(torch.arange(40.0).view(40, 1))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    with pytest.warns(UserWarning, match="GLOBAL expected batch size"):
        private = DistributedDPDataLoader.from_data_loader(loader)
    assert private.sample_rate == pytest.approx(8 / 40)


def test_out_of_order_batches_are_a_config_error_for_the_distributed_loader_too():
    with pytest.raises(ConfigError, match="DistributedDPDataLoader\\(in_order=False\\)"):
        DistributedDPDataLoader(TensorDataset(torch.zeros(4, 1)), sample_rate=0.5, in_order=False)


DEFAULT_RATE, DEFAULT_STEPS = 0.5, 2   # one epoch: ceil(1 / q) steps


@pytest.fixture(scope="module")
def default_ranks(tmp_path_factory):
    """Two ranks, each building two default loaders after the same torch.manual_seed."""
    ranks = workers.run_ranks(workers.default_sampling_worker, tmp_path_factory.mktemp("ranks"),
                              args=(DEFAULT_RATE, DEFAULT_STEPS))
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    return ranks


def test_by_default_the_ranks_draw_one_poisson_batch_from_rank_0s_sampling_generator(
        default_ranks):
    for built in range(2):
        states = [rank["loaders"][built]["state"] for rank in default_ranks]
        assert all(torch.equal(states[0], state) for state in states)
        generator = torch.Generator()
        generator.set_state(states[0])
        single = list(PoissonBatchSampler(workers.N, DEFAULT_RATE, steps=DEFAULT_STEPS,
                                          generator=generator))
        unions = [sorted(i for rank in default_ranks for i in rank["loaders"][built]["batches"][s])
                  for s in range(DEFAULT_STEPS)]
        assert unions == single


def test_by_default_the_ranks_sampling_seed_is_not_fixed_by_the_public_seed(default_ranks):
    first, second = default_ranks[0]["loaders"]
    assert not torch.equal(first["state"], second["state"])
    assert first["batches"] != second["batches"]


# -- every selection strategy through the one sharding rule, over real gloo ranks ---------------
SHARDED_KINDS = {"poisson": (0.25, 1), "cyclic_poisson": (0.1, 3), "balls_in_bins": (0.25, 1),
                 "shuffle": (0.25, 1)}


def strategy_loader(kind: str, seed: int, distributed: bool, secure: bool = False):
    """The private loader of selection `kind` over range(N), as make_private builds it."""
    from dptrain.privacy.selection import LoaderContext, Selection

    q, groups = SHARDED_KINDS[kind]
    context = LoaderContext(generator=None if secure else torch.Generator().manual_seed(seed),
                            secure=secure, distributed=distributed)
    data = DataLoader(TensorDataset(torch.arange(workers.N)), batch_size=round(q * workers.N))
    return Selection(q, kind=kind, groups=groups).private_loader(data, context)


def strategies_worker(rank: int, world_size: int, port: int) -> dict:
    """Each kind's loader built with a rank-specific seed (rank 0's generator must win), two
    epochs of this rank's batches; and the secure loaders' batches."""
    workers.init_gloo(rank, world_size, port)
    result: dict = {}
    for kind in SHARDED_KINDS:
        loader = strategy_loader(kind, seed=100 + rank, distributed=True)
        result[kind] = [b.tolist() for _ in range(2) for (b,) in loader]
        if kind != "shuffle":
            secure = strategy_loader(kind, seed=0, distributed=True, secure=True)
            result[f"{kind}_secure"] = [b.tolist() for _ in range(2) for (b,) in secure]
            result[f"{kind}_secure_seed"] = getattr(secure.batch_sampler, "partition_seed", None)
    return result


def test_every_strategys_rank_shares_make_up_the_one_process_batch_of_rank_0s_generator(tmp_path):
    from dptrain.data.cyclic_sampling import partition

    ranks = workers.run_ranks(strategies_worker, tmp_path)
    for result in ranks:
        assert "crash" not in result, result.get("crash")
    world = len(ranks)
    for kind in SHARDED_KINDS:
        reference = strategy_loader(kind, seed=100, distributed=False)
        single = [b.tolist() for _ in range(2) for (b,) in reference]
        for step, batch in enumerate(single):
            parts = [rank[kind][step] for rank in ranks]
            assert all(i % world == r for r, part in enumerate(parts) for i in part), kind
            assert sorted(i for part in parts for i in part) == batch, (kind, step)
        if kind == "shuffle":
            continue
        secure = [rank[f"{kind}_secure"] for rank in ranks]
        for r, batches in enumerate(secure):
            assert all(i % world == r for batch in batches for i in batch)
        if kind == "balls_in_bins":   # every example once an epoch, over the ranks
            steps = len(secure[0]) // 2
            for epoch in range(2):
                got = sorted(i for b in secure for batch in b[epoch * steps:(epoch + 1) * steps]
                             for i in batch)
                assert got == list(range(workers.N))
        if kind == "cyclic_poisson":  # rank 0's partition on every rank
            seeds = {rank[f"{kind}_secure_seed"] for rank in ranks}
            assert len(seeds) == 1 and None not in seeds
            group = partition(workers.N, 3, seeds.pop())
            for batches in secure:
                assert all(int(group[i]) == s % 3 for s, b in enumerate(batches) for i in b)
