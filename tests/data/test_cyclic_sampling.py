"""Cyclic Poisson sampling: b fixed groups, group t mod b Poisson-sampled at step t."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data.cyclic_sampling import (
    EQUAL_SPLIT,
    CyclicPoissonBatchSampler,
    CyclicPoissonDataLoader,
    DistributedCyclicPoissonBatchSampler,
    equal_split,
    partition,
)
from dptrain.errors import ConfigError, PrivacyError
from dptrain.randomness import make_generator


def _draws(sampler: CyclicPoissonBatchSampler, steps: int) -> list[list[int]]:
    return [sampler.draw() for _ in range(steps)]


def test_adding_an_example_never_moves_another_examples_group():
    # add/remove: with the same coins, N + 1 examples keep the groups the first N had
    for n, groups, seed in [(1442, 2, 0), (1000, 7, 1), (65_537, 22, 2)]:
        assert torch.equal(partition(n + 1, groups, seed)[:n], partition(n, groups, seed))
    smaller = CyclicPoissonBatchSampler(300, 0.05, groups=4, generator=make_generator(8))
    larger = CyclicPoissonBatchSampler(301, 0.05, groups=4, generator=make_generator(8))
    assert torch.equal(larger.group_of[:300], smaller.group_of)


def test_each_examples_group_is_drawn_independently_so_group_sizes_are_binomial():
    # N = 1442, b = 2: an equal split is always 721/721; independent groups give
    # Binomial(1442, 1/2) sizes (std sqrt(1442) / 2 = 19.0, P(exactly 721) = 2.1 %)
    n, seeds = 1442, 400
    sizes = torch.tensor([int((partition(n, 2, seed) == 0).sum()) for seed in range(seeds)],
                         dtype=torch.float64)
    assert abs(sizes.mean().item() - n / 2) < 4 * 19.0 / seeds ** 0.5
    assert 16.0 < sizes.std().item() < 22.0
    assert (sizes == n / 2).double().mean().item() < 0.06
    # and two examples' groups are independent: (group of 0, group of 1) uniform over 3 x 3
    pairs = torch.stack([partition(2, 3, seed) for seed in range(900)])
    cells = torch.bincount(pairs[:, 0] * 3 + pairs[:, 1], minlength=9).double()
    chi2 = float(((cells - 100.0) ** 2 / 100.0).sum())
    assert chi2 < 26.1                                            # 8 df, p = 0.001


def test_a_group_drawn_empty_gives_empty_batches_at_its_steps():
    # 4 examples in 4 groups: some group is empty with probability 1 - 4! / 4^4 = 0.91
    for seed in range(20):
        sampler = CyclicPoissonBatchSampler(4, 0.25, groups=4, generator=make_generator(seed))
        empty = [g for g in range(4) if not bool((sampler.group_of == g).any())]
        if empty:
            break
    assert empty
    batches = _draws(sampler, 12)
    assert all(batches[step] == [] for step in range(12) if step % 4 in empty)
    assert any(batches)                                           # the others' groups draw


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


def test_a_resume_that_would_rebuild_other_groups_is_refused_and_changes_nothing():
    first = CyclicPoissonBatchSampler(60, 0.1, groups=3, generator=make_generator(9))
    _draws(first, 4)
    state = dict(first.state_dict(), partition_sha256="0" * 64)   # another torch's groups
    resumed = CyclicPoissonBatchSampler(60, 0.1, groups=3, generator=make_generator(9))
    with pytest.raises(PrivacyError, match="groups cannot be rebuilt"):
        resumed.load_state_dict(state)
    assert resumed.batches_drawn == 0 and resumed.partition_seed is None


def test_a_checkpoint_of_an_equal_split_resumes_with_its_groups_and_says_zero_out():
    seed = 12345
    legacy = {"batches_drawn": 4, "groups": 3, "partition_seed": seed}  # no "partition" key
    resumed = CyclicPoissonBatchSampler(60, 0.1, groups=3, generator=make_generator(10))
    with pytest.warns(UserWarning, match="equal split.*zero-out"):
        resumed.load_state_dict(legacy)
    assert torch.equal(resumed.group_of, equal_split(60, 3, seed))
    assert resumed.state_dict()["partition"] == EQUAL_SPLIT        # and stays one on resume


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
