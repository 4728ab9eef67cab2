"""make_private with a noise strategy: refused while no accountant charges it; once one does
(the accounting seam, patched here), the strategy reaches the DP optimizer in hooks and ghost
modes and its buffers go through the engine's checkpoint state exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt, Independent
from dptrain.privacy.noise import accounting
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
        x, y = next(batches)
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.module(x), y).backward()
        private.optimizer.step()
        out.append(torch.cat([p.detach().reshape(-1).clone()
                              for p in private.module.parameters()]))
    return out


@pytest.fixture()
def banded_accounted(monkeypatch):
    """As if the matrix-factorization accounting had registered correlated noise."""
    monkeypatch.setattr(accounting, "ACCOUNTED", accounting.ACCOUNTED | {
        ("banded", "poisson"), ("blt", "poisson")})


@pytest.mark.parametrize("strategy", [Banded((1.0, 0.5)), Blt((0.9,), (0.3,))],
                         ids=lambda s: s.name)
def test_make_private_refuses_correlated_noise_no_accountant_charges(strategy):
    with pytest.raises(ConfigError, match="no privacy accounting"):
        _private(strategy)


def test_make_private_defaults_to_independent_noise():
    private = _private(None)
    assert private.optimizer.noise_strategy == Independent()
    assert private.engine.plan.noise.strategy == Independent()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_plans_strategy_drives_the_optimizers_noise(banded_accounted, mode):
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
def test_a_run_resumed_from_a_checkpoint_continues_as_if_uninterrupted(banded_accounted,
                                                                       strategy, tmp_path):
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


def test_the_released_model_holds_no_noise_buffer(banded_accounted):
    private = _private(Banded((1.0, 0.5)))
    _train(private, 2)
    assert set(private.module._module.state_dict()) == {"0.weight", "0.bias", "2.weight",
                                                         "2.bias"}


def test_a_noise_strategy_beside_a_plan_with_another_is_refused():
    private = _private(None)
    with pytest.raises(ConfigError, match="differs from the plan"):
        private.engine.make_private(module=nn.Linear(2, 2), optimizer=None, data_loader=None,
                                    plan=private.engine.plan, noise_strategy=Banded((1.0, 0.5)))
