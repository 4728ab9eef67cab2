"""Learning-rate schedules: the rate of each logical step is a function of the step alone, is
logged, survives a resume, and the ledger records it as costing no privacy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_trainer_support import final_weights, make_job, make_settings

from dptrain.errors import ConfigError
from dptrain.train.ledger import load_ledger
from dptrain.train.loop import train
from dptrain.train.lr_schedule import LR_SCHEDULE_NOTE, LRSchedule, make_lr_scheduler

STEPS_PER_EPOCH, EPOCHS, BASE_LR = 4, 3, 0.1   # make_job: 48 examples, batches of 12, SGD lr 0.1
LINEAR = {"kind": "linear", "warmup_steps": 2}


def _epoch_rates(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["lr"] for line in lines if "epoch" in line and not line.get("final")]


def test_linear_schedule_warms_up_then_decays_to_zero_at_the_last_step() -> None:
    schedule = LRSchedule("linear", warmup_steps=4)
    factors = [schedule.factor(step, 10) for step in range(11)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[4:] == pytest.approx([1 - i / 6 for i in range(7)])


def test_cosine_schedule_is_a_half_cosine_after_the_warm_up() -> None:
    schedule = LRSchedule("cosine", warmup_fraction=0.25)
    assert schedule.warmup(8) == 2
    assert [schedule.factor(s, 8) for s in range(2, 9)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * i / 6)) for i in range(7)])


def test_warmup_steps_win_over_warmup_fraction() -> None:
    assert LRSchedule("linear", warmup_steps=3, warmup_fraction=0.5).warmup(100) == 3


def test_constant_schedule_keeps_the_rate() -> None:
    assert {LRSchedule().factor(s, 5) for s in range(5)} == {1.0}


@pytest.mark.parametrize("fields", [{"kind": "step"}, {"kind": "linear", "warmup_steps": -1},
                                    {"kind": "cosine", "warmup_fraction": 1.0}])
def test_bad_schedule_values_are_refused_naming_the_key(fields: dict) -> None:
    with pytest.raises(ConfigError, match=r"lr_schedule\.\w+="):
        LRSchedule(**fields)


def test_scheduler_sets_each_steps_rate_from_the_schedule() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = LRSchedule("linear", warmup_steps=1)
    scheduler = make_lr_scheduler(optimizer, schedule, 5)
    rates = []
    for _ in range(5):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([2.0 * schedule.factor(s, 5) for s in range(5)])


def test_a_private_run_follows_the_schedule_and_logs_each_epochs_rate(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=EPOCHS, lr_schedule=LINEAR))
    total = EPOCHS * STEPS_PER_EPOCH
    expected = [BASE_LR * LRSchedule(**LINEAR).factor(e * STEPS_PER_EPOCH, total)
                for e in range(1, EPOCHS + 1)]
    assert _epoch_rates(tmp_path) == pytest.approx(expected)


def test_the_ledger_records_the_schedule_as_costing_no_privacy(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=EPOCHS, lr_schedule=LINEAR))
    assert load_ledger(tmp_path)["lr_schedule"] == {
        "kind": "linear", "warmup_steps": 2, "total_steps": EPOCHS * STEPS_PER_EPOCH,
        "privacy": LR_SCHEDULE_NOTE}


def test_a_scheduled_run_resumed_mid_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    straight = make_job(dropout=0.3)
    train(straight, make_settings(tmp_path / "a", epochs=EPOCHS, lr_schedule=LINEAR))
    stopped = make_job(dropout=0.3)
    train(stopped, make_settings(tmp_path / "b", epochs=EPOCHS, lr_schedule=LINEAR,
                                 max_steps=STEPS_PER_EPOCH + 2))
    resumed = make_job(dropout=0.3)
    train(resumed, make_settings(tmp_path / "b", epochs=EPOCHS, lr_schedule=LINEAR,
                                 resume="auto"))
    for name, value in final_weights(straight).items():
        assert torch.equal(value, final_weights(resumed)[name]), name
    assert _epoch_rates(tmp_path / "b")[-1] == _epoch_rates(tmp_path / "a")[-1]


def test_a_callers_own_scheduler_is_stepped_per_logical_step_and_named_in_the_ledger(
        tmp_path: Path) -> None:
    job = make_job()
    job.lr_scheduler = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=1, gamma=0.5)
    train(job, make_settings(tmp_path, epochs=1))
    assert job.optimizer.param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.5 ** STEPS_PER_EPOCH)
    assert load_ledger(tmp_path)["lr_schedule"] == {"kind": "StepLR", "privacy": LR_SCHEDULE_NOTE}
