"""Noise schedules: the ledger commits each upcoming step's exact sigma, and the guard follows it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_trainer_support import N_TRAIN, make_job, make_settings

from dptrain.train.ledger import (
    epsilon_of,
    history_from_json,
    load_ledger,
    truncate_history,
)
from dptrain.train.loop import train

Q = 12 / N_TRAIN
SCHEDULE = {"noise_schedule": {"kind": "step", "step_size": 3, "gamma": 0.8}}


def _sigma(step: int) -> float:
    return 1.0 * 0.8 ** (step // 3)


def test_committed_history_is_exactly_the_history_later_taken(tmp_path: Path) -> None:
    on_disk: list[list] = []

    def recording_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            data = json.loads((tmp_path / "privacy_ledger.json").read_text())
            on_disk.append(history_from_json(data["history"]))
        return torch.nn.functional.cross_entropy(out, y)

    train(make_job(loss_fn=recording_loss, engine_kwargs=SCHEDULE), make_settings(tmp_path))
    final = history_from_json(load_ledger(tmp_path)["history"])
    assert final == [(_sigma(i), Q, 3) for i in (0, 3, 6, 9)]
    for committed in on_disk:
        assert committed == truncate_history(final, sum(n for _, _, n in committed))


def test_budget_guard_follows_the_schedule(tmp_path: Path) -> None:
    taken = [(_sigma(i), Q, 1) for i in range(8)]
    target = (epsilon_of(taken[:6], 1e-5, "rdp") + epsilon_of(taken[:7], 1e-5, "rdp")) / 2
    result = train(make_job(target_epsilon=target, engine_kwargs=SCHEDULE), make_settings(tmp_path))
    assert (result.status, result.steps) == ("stopped_at_budget", 6)
    assert load_ledger(tmp_path)["epsilon"] <= target
