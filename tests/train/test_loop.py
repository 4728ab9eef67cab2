"""The training loop: metrics, evaluation, max_steps, checkpoints, bad settings (non-private)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_support import make_job, make_settings

from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import NON_PRIVATE_NOTE, load_ledger
from dptrain.train.loop import train
from dptrain.errors import ConfigError


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _private_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "private_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _all_metrics(run_dir: Path) -> list[dict]:
    """Each record of metrics.jsonl merged with its step's record of private_metrics.jsonl."""
    private = {line["step"]: line for line in _private_metrics(run_dir)}
    return [{**line, **private.get(line["step"], {})} for line in _metrics(run_dir)]


def test_non_private_run_completes_and_reports_no_epsilon(tmp_path: Path) -> None:
    result = train(make_job(private=False), make_settings(tmp_path))
    assert (result.status, result.steps, result.epochs_completed) == ("completed", 12, 3)
    assert result.epsilon is None and result.delta is None
    assert 0.0 <= result.test_accuracy <= 1.0


def test_non_private_ledger_says_there_is_no_privacy_guarantee(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path))
    ledger = load_ledger(tmp_path)
    assert ledger["note"] == NON_PRIVATE_NOTE and ledger["private"] is False
    assert ledger["status"] == "completed" and ledger["steps_completed"] == 12


def test_metrics_has_one_line_per_epoch_with_test_metrics_every_eval_every(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=4, eval_every=2))
    lines = _metrics(tmp_path)
    assert [line["epoch"] for line in lines] == [1, 2, 3, 4]
    assert ["test_accuracy" in line for line in lines] == [False, True, False, True]


def test_eval_every_zero_evaluates_only_at_the_end(tmp_path: Path) -> None:
    result = train(make_job(private=False), make_settings(tmp_path, epochs=2, eval_every=0))
    lines = _metrics(tmp_path)
    assert lines[-1].get("final") is True and result.test_loss == lines[-1]["test_loss"]
    assert not any("test_loss" in line for line in lines[:-1])


def test_max_steps_stops_mid_epoch(tmp_path: Path) -> None:
    result = train(make_job(private=False), make_settings(tmp_path, max_steps=6))
    assert (result.steps, result.epochs_completed) == (6, 1)


def test_checkpoints_every_epoch_plus_last(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=4, checkpoint_every=2))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["epoch_2.pt", "epoch_4.pt", "last.pt"]


def test_keep_best_writes_best_checkpoint(tmp_path: Path) -> None:
    train(make_job(private=False, validation=True), make_settings(tmp_path, keep_best=True))
    assert (tmp_path / "checkpoints" / "best.pt").is_file()


def test_keep_best_without_a_validation_split_is_refused_naming_dataset_validation_size(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dataset.validation_size"):
        train(make_job(private=False), make_settings(tmp_path, keep_best=True))
    assert not (tmp_path / "privacy_ledger.json").exists()


def test_evaluations_log_validation_metrics_privately_at_the_steps_of_the_test_metrics(
        tmp_path: Path) -> None:
    train(make_job(private=False, validation=True), make_settings(tmp_path, epochs=2))
    lines = _all_metrics(tmp_path)
    assert all({"val_loss", "val_accuracy", "test_loss", "test_accuracy"} <= set(line)
               for line in lines)
    assert all(0.0 <= line["val_accuracy"] <= 1.0 for line in lines)


def test_the_run_result_reports_the_last_validation_metrics(tmp_path: Path) -> None:
    result = train(make_job(private=False, validation=True), make_settings(tmp_path, epochs=2))
    last = _private_metrics(tmp_path)[-1]
    assert (result.val_accuracy, result.val_loss) == (last["val_accuracy"], last["val_loss"])
    assert result.selection_accuracy == result.val_accuracy


def test_without_a_validation_split_the_run_is_compared_by_test_accuracy(tmp_path: Path) -> None:
    result = train(make_job(private=False), make_settings(tmp_path, epochs=1))
    assert result.val_accuracy is None and result.selection_accuracy == result.test_accuracy


def test_without_a_validation_split_no_validation_metrics_are_logged(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=2))
    assert not any("val_accuracy" in line for line in _all_metrics(tmp_path))


def _mislabelled_validation(job):
    """The test examples with every label shifted: validation accuracy peaks where test
    accuracy does not, so a best checkpoint chosen on the wrong split is told apart."""
    x, y = job.test_loader.dataset.tensors
    job.validation_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (y + 1) % 3), batch_size=8)
    return job


def test_the_best_checkpoint_is_chosen_on_validation_accuracy_not_test_accuracy(
        tmp_path: Path) -> None:
    job = _mislabelled_validation(make_job(private=False, validation=True))
    train(job, make_settings(tmp_path, epochs=6, keep_best=True, checkpoint_every=0))
    lines = _all_metrics(tmp_path)
    by_validation = max(lines, key=lambda line: line["val_accuracy"])["step"]  # first maximum
    by_test = max(lines, key=lambda line: line["test_accuracy"])["step"]
    assert by_validation != by_test  # the data tells the two choices apart
    best = load_checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert best["step"] == by_validation


def test_a_new_best_between_checkpoint_epochs_is_saved_when_it_is_evaluated(
        tmp_path: Path) -> None:
    job = _mislabelled_validation(make_job(private=False, validation=True))
    train(job, make_settings(tmp_path, epochs=6, keep_best=True, checkpoint_every=0))
    ledger = load_ledger(tmp_path)
    best_steps = [c["step"] for c in ledger["checkpoints"] if c["path"].endswith("best.pt")]
    assert best_steps and best_steps[-1] < ledger["steps_completed"]  # not only at the end


def test_unwritable_output_folder_is_a_config_error_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="train.run_dir"):
        train(make_job(private=False), make_settings(blocker / "run"))


def test_negative_epochs_is_a_config_error_naming_the_python_argument(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"TrainSettings\.epochs=-1"):
        train(make_job(private=False), make_settings(tmp_path, epochs=-1))


def test_fresh_run_refuses_a_folder_holding_another_runs_ledger_naming_the_python_argument(
        tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=1))
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(ConfigError) as refused:
        train(make_job(private=False), make_settings(tmp_path, epochs=1))
    assert "TrainSettings(resume='auto')" in str(refused.value)
    assert "TrainSettings.run_dir" in str(refused.value)
    assert "train.resume" not in str(refused.value) and "hydra" not in str(refused.value)
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


def test_failure_inside_the_loop_marks_the_ledger_failed(tmp_path: Path) -> None:
    calls = {"n": 0}

    def exploding_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return torch.nn.functional.cross_entropy(out, y)

    with pytest.raises(RuntimeError, match="boom"):
        train(make_job(private=False, loss_fn=exploding_loss), make_settings(tmp_path))
    ledger = load_ledger(tmp_path)
    assert ledger["status"] == "failed" and "boom" in ledger["error"]


def test_bf16_precision_trains(tmp_path: Path) -> None:
    job = make_job(private=False)
    job.model.float()
    job.precision = "bf16"
    job.train_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(job.train_loader.dataset.tensors[0].float(),
                                       job.train_loader.dataset.tensors[1]), batch_size=12)
    job.test_loader = None
    result = train(job, make_settings(tmp_path, epochs=1))
    assert result.status == "completed" and result.test_loss is None


def test_training_keeps_freed_memory_in_the_heap_between_steps(tmp_path: Path, monkeypatch) -> None:
    import dptrain.train.loop as loop

    calls = []
    monkeypatch.setattr(loop, "retain_freed_memory", lambda: calls.append(True) or True)
    train(make_job(private=False), make_settings(tmp_path, max_steps=1))
    assert calls == [True]
