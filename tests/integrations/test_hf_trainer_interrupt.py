"""A PrivateTrainer run stopped by Ctrl-C (or an error) is charged every step whose batch was
drawn, not the whole block of steps committed ahead, and its warning and `dptrain-ledger` say how
many steps were charged beyond those trained, and why (dptrain/integrations/hf_trainer.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.test_hf_trainer import _privacy, _trainer, folders  # noqa: F401

transformers = pytest.importorskip("transformers")

from dptrain.cli.ledger_cmd import main as ledger_main  # noqa: E402
from dptrain.integrations.hf_trainer import default_per_example_loss  # noqa: E402
from dptrain.train.ledger import load_ledger, verify_ledger  # noqa: E402
from dptrain.formatting import format_epsilon

MAX_STEPS = 30   # one block: the Trainer commits all 30 before the first batch


class _CtrlCAfterStep(transformers.TrainerCallback):
    """Ctrl-C between two steps: after step `step` ends, before the next batch is drawn."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            raise KeyboardInterrupt
        return control


def _ctrl_c_in_step(trainer: Any, taken: int, extra_draws: int = 0) -> None:
    """Ctrl-C inside the step after `taken` steps, once its batch was drawn (and `extra_draws`
    more batches drawn ahead, as a loader's workers prefetch them)."""
    def loss(model: Any, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if trainer.dp_optimizer.steps_taken == taken:
            for _ in range(extra_draws):
                trainer.get_train_dataloader().poisson_sampler.draw()
            raise KeyboardInterrupt
        return default_per_example_loss(model, outputs, labels)

    trainer.per_example_loss_fn = loss


def _charged(run: Path) -> tuple[str, int, int, int]:
    ledger = load_ledger(run)
    return (ledger["status"], sum(r["steps"] for r in ledger["history"]),
            ledger["steps_completed"], ledger["committed_ahead"])


def test_ctrl_c_between_steps_charges_only_the_steps_taken(folders: dict[str, Path],
                                                           tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, max_steps=MAX_STEPS,
                       privacy=_privacy(noise_multiplier=1.0))
    trainer.add_callback(_CtrlCAfterStep(1))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert _charged(tmp_path) == ("interrupted", 1, 1, 0)   # was 30 charged, 29 ahead
    assert verify_ledger(tmp_path).ok and verify_ledger(tmp_path).note is None


def test_ctrl_c_inside_a_step_keeps_its_drawn_batch_charged_and_says_why(
        folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _trainer(folders, tmp_path, max_steps=MAX_STEPS,
                       privacy=_privacy(noise_multiplier=1.0))
    _ctrl_c_in_step(trainer, taken=1)
    with caplog.at_level(logging.WARNING, logger="dptrain.integrations.hf_trainer"), \
            pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert _charged(tmp_path) == ("interrupted", 2, 1, 1)
    why = ("1 step charged beyond the 1 that finished: committed to the ledger before its "
           "batch was drawn (a step is charged before it touches the data) and kept when the "
           "run stopped (interrupted)")
    warning = " ".join(caplog.text.split())
    assert "PrivateTrainer interrupted after 1 step; its privacy ledger" in warning
    assert f"charges 2 steps, epsilon {format_epsilon(load_ledger(tmp_path)['epsilon'])}" in warning
    assert why in warning and "The other 28 steps committed ahead had no batch drawn" in warning
    result = verify_ledger(tmp_path)
    assert result.ok and result.message == "matches" and result.note == why
    capsys.readouterr()
    assert ledger_main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["note"] == why


def test_batches_drawn_ahead_of_the_step_in_progress_stay_charged(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """Batches a loader's workers drew ahead may hold examples: their steps stay charged."""
    trainer = _trainer(folders, tmp_path, max_steps=MAX_STEPS,
                       privacy=_privacy(noise_multiplier=1.0))
    _ctrl_c_in_step(trainer, taken=1, extra_draws=3)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert _charged(tmp_path) == ("interrupted", 5, 1, 4)


def test_an_error_inside_a_step_is_charged_like_ctrl_c(folders: dict[str, Path],
                                                       tmp_path: Path) -> None:
    trainer = _trainer(folders, tmp_path, max_steps=MAX_STEPS,
                       privacy=_privacy(noise_multiplier=1.0))

    def out_of_memory(model: Any, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if trainer.dp_optimizer.steps_taken == 2:
            raise RuntimeError("out of memory")
        return default_per_example_loss(model, outputs, labels)

    trainer.per_example_loss_fn = out_of_memory
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    assert _charged(tmp_path) == ("failed", 3, 2, 1)
