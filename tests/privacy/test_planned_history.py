"""planned_history: what a plan's steps will charge, known before any data is read, equals what
the accountant records when the steps run (sigma and q by the plan's schedules)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting.history import merge_history
from dptrain.errors import ConfigError
from dptrain.privacy.plan import planned_history

N, BATCH, STEPS = 40, 8, 7


@pytest.mark.parametrize("schedules", [
    {},
    {"noise_schedule": {"kind": "exponential", "gamma": 0.9}},
    {"sample_rate_schedule": {"kind": "step", "step_size": 3, "gamma": 0.5}},
], ids=["constant", "noise schedule", "sample-rate schedule"])
def test_the_planned_history_is_what_the_accountant_records(schedules):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(N, 3), torch.randint(2, (N,))), batch_size=BATCH)
    private = dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                           lr=0.1),
                                   data_loader=data, noise_multiplier=1.2, accountant="rdp",
                                   **schedules)
    steps = 0
    while steps < STEPS:
        for x, y in private.data_loader:
            nn.functional.cross_entropy(private.module(x), y).backward()
            private.optimizer.step()
            private.optimizer.zero_grad()
            steps += 1
            if steps == STEPS:
                break
    recorded = merge_history(private.engine.accountant.history)
    assert planned_history(private.engine.plan, STEPS) == recorded


def test_a_python_schedule_has_no_planned_history():
    model = nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(N, 3), torch.randint(2, (N,))), batch_size=BATCH)
    plan = dptrain.PrivacyEngine().plan_of(data, noise_multiplier=1.0,
                                           noise_schedule=lambda step: 1.0)
    with pytest.raises(ConfigError, match="noise_schedule"):
        planned_history(plan, 3)
