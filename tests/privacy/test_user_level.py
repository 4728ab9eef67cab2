"""User-level DP-SGD (privacy_unit="user"): each sampled user's mean gradient is clipped to C,
checked against float64 micro-batch ground truth (each example's gradient from the model run on it
alone)."""

from __future__ import annotations

import math

import pytest
import torch
from privacy_helpers import clipped_sum, per_sample_grads, tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import get_accountant, get_noise_multiplier
from dptrain.errors import ConfigError

LOSS = nn.CrossEntropyLoss(reduction="sum")


def _data(user_ids: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = len(user_ids)
    return (torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3,
            torch.randint(0, 2, (n,), generator=gen))


def _private(x, y, user_ids, *, batch_size, sigma=0.0, C=0.3, seed=0, **kwargs):
    """make_private at user level over (x, y) with a reproducible mechanism."""
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=seed, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=sigma, max_grad_norm=C, privacy_unit="user",
        user_ids=torch.tensor(user_ids), **kwargs)
    return engine, model, module, optimizer, loader


def _noise_free_sum_of_one_step(module, optimizer, batches) -> tuple[dict, torch.Tensor]:
    """(the noise-free clipped sum {p: Tensor[*p.shape]} of one logical step, the rows trained)."""
    captured = {}
    optimizer.attach_step_hook(
        lambda opt: captured.update({p: p.summed_grad.clone() for p in opt.params}))
    rows = []
    for x, y in batches:
        optimizer.zero_grad()
        rows.append(x)
        if len(x):
            nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        if captured:
            break
    return captured, torch.cat(rows)


def _user_mean_clipped_sum(model, x, y, user_ids, C) -> dict:
    """Ground truth: each user's mean of its examples' micro-batch gradients, clipped to C, summed."""
    grads = per_sample_grads(model, LOSS, x, y)
    users = sorted(set(user_ids), key=user_ids.index)
    means = {p: torch.stack([g[[i for i, u in enumerate(user_ids) if u == user]].mean(0)
                             for user in users]) for p, g in grads.items()}
    return clipped_sum(means, C)


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_user_with_many_examples_moves_the_noise_free_clipped_sum_by_at_most_C():
    user_ids = [0] * 20 + [1, 2, 3]
    x, y = _data(user_ids)
    C = 0.05
    _, _, module, optimizer, loader = _private(x, y, user_ids, batch_size=4, C=C)  # q = 1
    with_user, _ = _noise_free_sum_of_one_step(module, optimizer, loader)
    _, _, module, optimizer, loader = _private(x[20:], y[20:], user_ids[20:], batch_size=3, C=C)
    without_user, _ = _noise_free_sum_of_one_step(module, optimizer, loader)
    moved = math.sqrt(sum((a - b).pow(2).sum().item()
                          for a, b in zip(with_user.values(), without_user.values())))
    assert C * 0.5 < moved <= C * (1 + 1e-12)  # clipped to C, not 20 C as 20 examples would be


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_user_with_one_example_each_trains_exactly_as_example_level():
    n = 24
    x, y = _data(list(range(n)))
    finals = []
    for unit in ("example", "user"):
        model = tiny_model()
        engine = dptrain.PrivacyEngine(accountant="rdp", seed=5, reproducible_mechanism=True)
        extra = {"privacy_unit": "user", "user_ids": torch.arange(n)} if unit == "user" else {}
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6), noise_multiplier=0.7,
            max_grad_norm=0.3, **extra)
        for xb, yb in loader:
            optimizer.zero_grad()
            if len(xb):
                nn.functional.cross_entropy(module(xb), yb).backward()
            optimizer.step()
        finals.append(([p.detach().clone() for p in model.parameters()],
                       engine.accountant.get_epsilon(delta=1e-3)))
    (example_params, example_eps), (user_params, user_eps) = finals
    for a, b in zip(example_params, user_params):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert user_eps == example_eps


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_the_clipped_sum_is_the_sum_of_each_users_clipped_mean_micro_batch_gradient():
    user_ids = [7, 7, 3, 9, 9, 9, 3, 5, 7, 7, 7, 1]
    x, y = _data(user_ids)
    _, model, module, optimizer, loader = _private(x, y, user_ids, batch_size=5, C=0.3)  # q = 1
    summed, rows = _noise_free_sum_of_one_step(module, optimizer, loader)
    order = [(rows == x[i]).all(1).nonzero().item() for i in range(len(user_ids))]
    assert sorted(order) == list(range(len(user_ids)))  # every example trained once
    reference = tiny_model()  # the same initial weights
    expected = _user_mean_clipped_sum(reference, x, y, user_ids, 0.3)
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(summed[p], expected[p_ref], rtol=1e-12, atol=1e-14)


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_user_cut_across_physical_chunks_is_clipped_once_as_a_whole():
    user_ids = [0] * 5 + [1] * 3 + [2] * 4
    x, y = _data(user_ids)
    _, model, module, optimizer, loader = _private(x, y, user_ids, batch_size=3, C=0.3)  # q = 1
    with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                    max_physical_batch_size=2) as chunks:
        summed, _ = _noise_free_sum_of_one_step(module, optimizer, chunks)
    reference = tiny_model()  # the same initial weights
    expected = _user_mean_clipped_sum(reference, x, y, user_ids, 0.3)
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(summed[p], expected[p_ref], rtol=1e-12, atol=1e-14)


def test_epsilon_is_the_example_level_accountants_at_the_users_rate_and_count():
    user_ids = [u for u in range(16) for _ in range(u % 3 + 1)]  # 16 users, 32 examples
    x, y = _data(user_ids)
    engine, _, module, optimizer, loader = _private(x, y, user_ids, batch_size=4, sigma=1.1)
    steps = 0
    for xb, yb in loader:
        optimizer.zero_grad()
        if len(xb):
            nn.functional.cross_entropy(module(xb), yb).backward()
        optimizer.step()
        steps += 1
    assert optimizer.sample_rate == 4 / 16 and engine.dataset_size == 16
    reference = get_accountant("rdp")
    for _ in range(steps):
        reference.step(noise_multiplier=1.1, sample_rate=4 / 16)
    assert engine.accountant.get_epsilon(delta=1e-3) == reference.get_epsilon(delta=1e-3)


def test_make_private_with_epsilon_calibrates_sigma_at_the_users_rate():
    user_ids = [u for u in range(20) for _ in range(3)]  # 20 users, 60 examples
    x, y = _data(user_ids)
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    _, optimizer, _ = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=5), max_grad_norm=1.0,
        target_epsilon=2.0, target_delta=1e-3, epochs=2, privacy_unit="user",
        user_ids=torch.tensor(user_ids))
    expected = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-3,
                                    sample_rate=5 / 20, epochs=2, accountant="rdp")
    assert optimizer.sample_rate == 5 / 20
    assert optimizer.noise_multiplier == expected


def test_user_ids_of_the_wrong_length_are_a_config_error_naming_user_ids():
    x, y = _data([0, 0, 1])
    with pytest.raises(ConfigError, match="user_ids has 2 ids"):
        _private(x, y, [0, 1], batch_size=1)


def test_user_ids_without_privacy_unit_user_are_a_config_error_not_silently_example_level():
    x, y = _data([0, 0, 1])
    model = tiny_model()
    with pytest.raises(ConfigError, match="privacy_unit='user'"):
        dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                             data_loader=DataLoader(TensorDataset(x, y), batch_size=1),
                             noise_multiplier=1.0, max_grad_norm=1.0, user_ids=[0, 0, 1])


def test_user_level_without_poisson_sampling_is_a_config_error_naming_it():
    x, y = _data([0, 0, 1])
    with pytest.raises(ConfigError, match="poisson_sampling"):
        _private(x, y, [0, 0, 1], batch_size=1, poisson_sampling=False, allow_non_poisson=True)
