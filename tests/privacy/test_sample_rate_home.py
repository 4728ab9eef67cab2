"""q has one home: the plan's selection, evaluated by batch in one place, the private loader's
sampler. The loader, the DP optimizer, the engine and the ledger's mechanism take q from the
plan, and the budget forecast (dptrain.train.budget: `PrivacySpend.upcoming`) commits the next
steps at the q of the batches the loader hands out next (`engine.upcoming_sample_rates`, the
sampler's `upcoming_rates`), which is what the accountant then charges (each step at the q its
batch was drawn with): a Poisson batch drawn and never stepped on under a sample-rate schedule
cannot make them disagree, as indexing the schedule by step did."""

from __future__ import annotations

import pytest
import torch
from privacy_helpers import loop_step, tiny_model
from torch.utils.data import DataLoader, TensorDataset

import dptrain
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


@pytest.mark.parametrize("sampling", COMMAND_SELECTIONS)
def test_loader_optimizer_engine_and_plan_hold_the_same_q(sampling: str):
    engine, model, optimizer, loader = _private(sampling=sampling)
    q = engine.plan.selection.sample_rate
    assert loader.sample_rate == optimizer.sample_rate == q
    assert engine.upcoming_sample_rates(2) == [q, q]
    for batch in loader:
        loop_step(model, optimizer, batch)
    assert {rate for _, rate, _ in engine.accountant.history} == {q}


def test_under_a_rate_schedule_each_step_is_charged_the_q_the_forecast_committed():
    schedule = StepSchedule(0.125, gamma=0.5, step_size=3)
    engine, model, optimizer, loader = _private(sample_rate_schedule=schedule)
    forecast = engine.upcoming_sample_rates(8)                   # what the budget commits
    for batch in loader:
        loop_step(model, optimizer, batch)
    charged = [rate for _, rate, n in engine.accountant.history for _ in range(n)]
    assert charged == forecast


def test_a_skipped_poisson_batch_under_a_rate_schedule_leaves_forecast_and_charge_equal():
    """Batch 1 is drawn and never stepped on: steps 1, 2, 3 release batches 2, 3, 4, and the
    forecast made after the skip commits their q (indexing the schedule by step would commit
    q(1), q(2), q(3))."""
    schedule = StepSchedule(0.125, gamma=0.5, step_size=1)
    engine, model, optimizer, loader = _private(sample_rate_schedule=schedule)
    batches = iter(loader)
    loop_step(model, optimizer, next(batches))
    next(batches)                                                  # drawn, never stepped on
    forecast = engine.upcoming_sample_rates(3)
    for _ in range(3):
        loop_step(model, optimizer, next(batches))
    charged = [rate for _, rate, n in engine.accountant.history for _ in range(n)][1:]
    assert charged == forecast == [schedule(2), schedule(3), schedule(4)]


def test_the_forecast_counts_batches_drawn_ahead_at_the_q_they_were_drawn_with():
    schedule = StepSchedule(0.125, gamma=0.5, step_size=1)
    engine, _, _, loader = _private(sample_rate_schedule=schedule)
    sampler = loader.poisson_sampler
    drawn = iter(sampler)
    next(drawn), next(drawn)                                       # prefetched, not handed out
    assert engine.upcoming_sample_rates(3) == [schedule(0), schedule(1), schedule(2)]
