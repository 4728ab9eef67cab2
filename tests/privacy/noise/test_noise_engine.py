"""make_private with a noise strategy: its steps are charged by the matrix-factorization
accounting of its own column (never as DP-SGD), the strategy reaches the DP optimizer in hooks
and ghost modes and its buffers go through the engine's checkpoint state exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import compute_epsilon
from dptrain.accounting.gdp import gdp_epsilon
from dptrain.accounting.matrix_factorization import (
    amplified_history,
    cyclic_participation,
    unamplified_mu,
)
from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt, Independent
from dptrain.train.checkpoint import load_checkpoint, save_checkpoint

N, FEATURES, CLASSES = 32, 6, 3


def _private(strategy, seed=0, grad_sample_mode="hooks", **kwargs):
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(N, FEATURES, generator=gen),
                         torch.randint(0, CLASSES, (N,), generator=gen))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    return dptrain.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        seed=seed, reproducible_mechanism=True, noise_strategy=strategy,
        grad_sample_mode=grad_sample_mode, **kwargs)


def _train(private, steps):
    """`steps` steps of the private loop; the weights after each (flattened)."""
    out = []
    batches = iter(private.data_loader)
    for _ in range(steps):
        x, y = next(batches, (None, None))
        if x is None:  # the epoch is over: the next one
            batches = iter(private.data_loader)
            x, y = next(batches)
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.module(x), y).backward()
        private.optimizer.step()
        out.append(torch.cat([p.detach().reshape(-1).clone()
                              for p in private.module.parameters()]))
    return out


def test_a_banded_run_is_charged_as_amplified_banded_mf_of_its_column_not_as_dp_sgd():
    strategy = Banded((1.0, 0.5))
    private = _private(strategy)
    _train(private, 6)
    history, delta = private.engine.accountant.history, 1e-5
    assert private.engine.plan.selection.groups == 2 and history == [(1.0, 0.25, 6)]
    rounds = amplified_history(history, 2, strategy.toeplitz_column(6))
    assert private.engine.get_epsilon(delta) == compute_epsilon(rounds, delta, "prv")
    assert private.engine.get_epsilon(delta) != pytest.approx(
        compute_epsilon(history, delta, "prv"), rel=0.01)


def test_a_blt_run_is_charged_by_its_min_separation_sensitivity_not_as_dp_sgd():
    strategy = Blt((0.9,), (0.3,))
    private = _private(strategy)
    _train(private, 8)
    history, delta = private.engine.accountant.history, 1e-5
    groups = private.engine.plan.selection.groups
    assert groups == 4 and history == [(1.0, 0.25, 8)]
    mu = unamplified_mu(history, strategy.toeplitz_column(8),
                        cyclic_participation(history, groups), 1.0)
    assert private.engine.get_epsilon(delta) == gdp_epsilon(mu, delta)
    assert private.engine.get_epsilon(delta) != pytest.approx(
        compute_epsilon(history, delta, "prv"), rel=0.01)


def test_make_private_defaults_to_independent_noise():
    private = _private(None)
    assert private.optimizer.noise_strategy == Independent()
    assert private.engine.plan.noise.strategy == Independent()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_plans_strategy_drives_the_optimizers_noise(mode):
    strategy = Banded((1.0, 0.5, 0.25))
    private = _private(strategy, grad_sample_mode=mode)
    assert private.engine.plan.noise.strategy == strategy
    assert private.engine.plan.to_dict()["noise"]["strategy"]["coefficients"] == list(
        strategy.coefficients)
    _train(private, 3)
    held = private.optimizer.noise_generator_state.buffers
    assert set(held) == set(range(4)) and all(len(b) == 2 for b in held.values())


@pytest.mark.parametrize("strategy", [Banded((1.0, 0.5, 0.25)), Blt((0.9, 0.4), (0.3, 0.2))],
                         ids=lambda s: s.name)
def test_a_run_resumed_from_a_checkpoint_continues_as_if_uninterrupted(strategy, tmp_path):
    whole = _train(_private(strategy), 4)
    first = _private(strategy)
    _train(first, 2)
    save_checkpoint(tmp_path / "last.pt", {
        "step": 2, "epoch": 0, "config": {}, "config_hash": "", "optimizer": {}, "rng": {},
        "generators": {}, "model": first.module._module.state_dict(),
        "engine": first.engine.state_dict()})
    state = load_checkpoint(tmp_path / "last.pt")
    second = _private(strategy)
    second.module._module.load_state_dict(state["model"])
    second.engine.load_state_dict(state["engine"])
    batches = iter(second.data_loader)  # the sampler resumes where the first run stopped
    for _ in range(2):
        x, y = next(batches)
        second.optimizer.zero_grad()
        nn.functional.cross_entropy(second.module(x), y).backward()
        second.optimizer.step()
    after = torch.cat([p.detach().reshape(-1) for p in second.module.parameters()])
    assert torch.equal(after, whole[-1])


def test_the_released_model_holds_no_noise_buffer():
    private = _private(Banded((1.0, 0.5)))
    _train(private, 2)
    assert set(private.module._module.state_dict()) == {"0.weight", "0.bias", "2.weight",
                                                         "2.bias"}


def test_a_noise_strategy_beside_a_plan_with_another_is_refused():
    private = _private(None)
    with pytest.raises(ConfigError, match="differs from the plan"):
        private.engine.make_private(module=nn.Linear(2, 2), optimizer=None, data_loader=None,
                                    plan=private.engine.plan, noise_strategy=Banded((1.0, 0.5)))
