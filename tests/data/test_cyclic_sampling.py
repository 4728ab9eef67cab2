"""Cyclic Poisson sampling: b fixed groups, group t mod b Poisson-sampled at step t."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data.cyclic_sampling import (
    CyclicPoissonBatchSampler,
    CyclicPoissonDataLoader,
    DistributedCyclicPoissonBatchSampler,
    partition,
)
from dptrain.errors import ConfigError
from dptrain.randomness import make_generator


def _draws(sampler: CyclicPoissonBatchSampler, steps: int) -> list[list[int]]:
    return [sampler.draw() for _ in range(steps)]


def test_the_partition_splits_the_examples_into_groups_differing_by_at_most_one():
    group = partition(103, 4, seed=7)
    sizes = torch.bincount(group, minlength=4)
    assert sizes.sum() == 103 and int(sizes.max() - sizes.min()) <= 1


def test_each_example_is_only_ever_in_the_steps_of_its_group():
    sampler = CyclicPoissonBatchSampler(200, 0.05, groups=4, generator=make_generator(1))
    for step, batch in enumerate(_draws(sampler, 400)):
        assert all(int(sampler.group_of[i]) == step % 4 for i in batch)


def test_an_example_joins_its_groups_steps_at_groups_times_q_and_a_batch_overall_at_q():
    n, q, groups, steps = 400, 0.02, 5, 5000
    sampler = CyclicPoissonBatchSampler(n, q, groups=groups, generator=make_generator(2))
    counts = np.zeros(n)
    sizes = []
    for batch in _draws(sampler, steps):
        counts[batch] += 1
        sizes.append(len(batch))
    # each example: steps / groups chances at rate groups * q, i.e. q per step overall
    rate = counts / (steps / groups)
    assert rate.mean() == pytest.approx(groups * q, rel=0.02)
    assert (counts / steps).mean() == pytest.approx(q, rel=0.02)
    assert np.mean(sizes) == pytest.approx(q * n, rel=0.02)       # the expected batch size q N


def test_more_groups_than_one_over_q_is_a_config_error_naming_sampling_groups():
    with pytest.raises(ConfigError, match="privacy.sampling_groups"):
        CyclicPoissonBatchSampler(100, 0.3, groups=4)


def test_a_resumed_sampler_keeps_its_partition_and_step_even_with_fresh_coins():
    first = CyclicPoissonBatchSampler(60, 0.1, groups=3)          # OS entropy: coins not saved
    _draws(first, 5)
    state = first.state_dict()
    resumed = CyclicPoissonBatchSampler(60, 0.1, groups=3)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.group_of, first.group_of)
    assert resumed.batches_drawn == 5
    assert all(int(resumed.group_of[i]) == 5 % 3 for i in resumed.draw())


def test_a_seeded_sampler_resumes_to_the_same_batches():
    first = CyclicPoissonBatchSampler(80, 0.05, groups=4, generator=make_generator(3))
    _draws(first, 3)
    state = first.state_dict()
    expected = _draws(first, 6)
    resumed = CyclicPoissonBatchSampler(80, 0.05, groups=4, generator=make_generator(99))
    resumed.load_state_dict(state)
    assert _draws(resumed, 6) == expected


def test_a_checkpoint_counts_the_steps_handed_out_not_the_batches_drawn_ahead():
    sampler = CyclicPoissonBatchSampler(40, 0.1, groups=2, generator=make_generator(4))
    iterator = iter(sampler)
    next(iterator), next(iterator), next(iterator)                 # drawn ahead by a prefetch
    sampler.hand_out()                                             # one reached the loop
    assert sampler.state_dict()["batches_drawn"] == 1


def test_batches_an_abandoned_iterator_drew_ahead_are_drawn_again_for_their_steps():
    data = TensorDataset(torch.arange(40.0))
    loader = CyclicPoissonDataLoader(data, 0.1, groups=2, generator=make_generator(5))
    sampler = loader.poisson_sampler
    iterator = iter(sampler)
    next(iterator)                                                 # drawn, never handed out
    for step, (x,) in enumerate(loader):                           # a fresh iterator
        assert all(int(sampler.group_of[int(i)]) == step % 2 for i in x)


def test_distributed_shards_make_up_the_single_process_batch():
    n, q, groups, world = 50, 0.1, 3, 4
    single = CyclicPoissonBatchSampler(n, q, groups=groups, generator=make_generator(6))
    single_batches = _draws(single, 8)
    seed = single.partition_seed
    ranks = []
    for rank in range(world):
        sampler = DistributedCyclicPoissonBatchSampler(n, q, groups, rank=rank, world_size=world,
                                                       generator=make_generator(6))
        sampler.partition_seed = sampler.new_partition_seed()      # as the loader does
        assert sampler.partition_seed == seed
        ranks.append(_draws(sampler, 8))
    for step in range(8):
        union = sorted(i for shard in ranks for i in shard[step])
        assert union == single_batches[step]
        assert all(i % world == rank for rank in range(world) for i in ranks[rank][step])


def test_the_loader_reads_batch_size_over_n_as_q_and_samples_groups_at_groups_times_q():
    data = TensorDataset(torch.arange(100.0))
    loader = CyclicPoissonDataLoader.from_data_loader(DataLoader(data, batch_size=5), groups=4)
    assert loader.sample_rate == pytest.approx(0.05)
    assert loader.poisson_sampler.group_rate == pytest.approx(0.2)
    assert len(loader) == 20                                       # an epoch: ceil(1 / q) steps
