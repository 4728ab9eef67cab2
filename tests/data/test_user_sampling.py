"""User-level Poisson sampling: users join at rate q, a sampled user gives at most k examples."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data.user_sampling import (
    UserDPDataLoader,
    UserPoissonBatchSampler,
    check_max_examples_per_user,
    user_groups,
)
from dptrain.errors import ConfigError

# 12 users with 1 .. 12 examples each, the examples of a user spread through the dataset.
USER_IDS = [u for _ in range(12) for u in range(12)]
USER_IDS = [u for i, u in enumerate(USER_IDS) if i // 12 <= u]


def _sampler(q: float, k: int | None, steps: int, seed: int = 0) -> UserPoissonBatchSampler:
    return UserPoissonBatchSampler(user_groups(USER_IDS, len(USER_IDS)), q, k, steps=steps,
                                   generator=torch.Generator().manual_seed(seed))


def _users_of(batch: list[int]) -> list[int]:
    return [USER_IDS[i] for i in batch]


def test_each_user_joins_a_batch_with_probability_q():
    q, steps = 0.3, 4000
    joined = torch.zeros(12)
    for batch in _sampler(q, None, steps):
        for user in set(_users_of(batch)):
            joined[user] += 1
    tolerance = 6 * math.sqrt(q * (1 - q) / steps)
    assert ((joined / steps - q).abs() < tolerance).all()


def test_a_sampled_user_gives_all_its_examples_without_a_cap():
    for batch in _sampler(0.5, None, 50):
        users = _users_of(batch)
        for user in set(users):
            assert users.count(user) == user + 1  # user u has u + 1 examples


def test_a_sampled_user_gives_at_most_k_of_its_examples_chosen_at_random():
    k, seen = 3, set()
    for batch in _sampler(1.0, k, 200):
        users = _users_of(batch)
        for user in range(12):
            assert users.count(user) == min(k, user + 1)
        seen.add(tuple(i for i in batch if USER_IDS[i] == 11))
    assert len(seen) > 50  # many different 3-subsets of user 11's 12 examples


def test_a_batch_lists_its_users_contiguously_with_their_positions():
    sampler = _sampler(0.5, 2, 20)
    for batch in sampler:
        sampler.hand_out()
        groups = sampler.handed_out_groups
        users = _users_of(batch)
        assert len(groups) == len(batch)
        assert all(int(g) == len(dict.fromkeys(users[: i + 1])) - 1 for i, g in enumerate(groups))


def test_the_loader_samples_users_at_batch_size_over_the_number_of_users():
    data = TensorDataset(torch.arange(len(USER_IDS)).float())
    loader = UserDPDataLoader.from_user_ids(DataLoader(data, batch_size=3), USER_IDS)
    assert loader.sample_rate == 3 / 12
    assert len(loader) == 4


def test_a_batch_size_above_the_number_of_users_is_a_config_error():
    data = TensorDataset(torch.arange(len(USER_IDS)).float())
    with pytest.raises(ConfigError, match="between 1 and the 12 users"):
        UserDPDataLoader.from_user_ids(DataLoader(data, batch_size=13), USER_IDS)


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_a_cap_that_is_not_a_positive_integer_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="privacy.max_examples_per_user"):
        check_max_examples_per_user(value, "privacy.max_examples_per_user")
