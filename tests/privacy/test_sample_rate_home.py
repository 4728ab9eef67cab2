"""q has one home: the plan's selection. The private loader, the DP optimizer, the engine's
per-step rate (which the budget forecast reads) and the ledger's mechanism all take q from it,
and a step can never be charged at another batch's q.

The budget forecast (dptrain.train.budget: `PrivacySpend.upcoming`) commits step t at
`engine.sample_rate_at(t)`; the accountant records the q batch t was drawn with. Under a
sample-rate schedule the two agree only while step t releases batch t, so a skipped Poisson batch
is refused there (the selection's `steps_follow_batches`)."""

from __future__ import annotations

import pytest
import torch
from privacy_helpers import tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.errors import PrivacyError
from dptrain.privacy.plan import COMMAND_SELECTIONS
from dptrain.privacy.schedules import StepSchedule

N = 48


def _loader(batch_size: int = 6) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    return DataLoader(TensorDataset(x, torch.randint(0, 2, (N,), generator=gen)),
                      batch_size=batch_size)


def _private(**kwargs):
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)
    return engine, model, optimizer, loader


def _step(model, optimizer, batch) -> None:
    x, y = batch
    optimizer.zero_grad()
    if len(x):
        nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("sampling", COMMAND_SELECTIONS)
def test_loader_optimizer_engine_and_plan_hold_the_same_q(sampling: str):
    engine, model, optimizer, loader = _private(sampling=sampling)
    q = engine.plan.selection.sample_rate
    assert loader.sample_rate == optimizer.sample_rate == engine.sample_rate_at(0) == q
    for batch in loader:
        _step(model, optimizer, batch)
    assert {rate for _, rate, _ in engine.accountant.history} == {q}


def test_under_a_rate_schedule_each_step_is_charged_the_q_the_forecast_committed():
    schedule = StepSchedule(0.125, gamma=0.5, step_size=3)
    engine, model, optimizer, loader = _private(sample_rate_schedule=schedule)
    forecast = [engine.sample_rate_at(t) for t in range(8)]      # what the budget commits
    for batch in loader:
        _step(model, optimizer, batch)
    charged = [rate for _, rate, n in engine.accountant.history for _ in range(n)]
    assert charged == forecast


def test_a_skipped_poisson_batch_under_a_rate_schedule_is_refused():
    """Skipping batch 1 would charge step 1 at q(2) where the forecast committed q(1)."""
    schedule = StepSchedule(0.125, gamma=0.5, step_size=1)
    engine, model, optimizer, loader = _private(sample_rate_schedule=schedule)
    batches = iter(loader)
    _step(model, optimizer, next(batches))
    next(batches)                                                  # drawn, never stepped on
    with pytest.raises(PrivacyError):
        _step(model, optimizer, next(batches))
    assert len(engine.accountant) == 1


def test_a_skipped_poisson_batch_at_a_constant_rate_is_allowed():
    """Without a schedule every batch has the same q: skipping one changes no charge."""
    engine, model, optimizer, loader = _private()
    batches = iter(loader)
    _step(model, optimizer, next(batches))
    next(batches)
    _step(model, optimizer, next(batches))
    assert engine.accountant.history == [(1.0, 0.125, 2)]
