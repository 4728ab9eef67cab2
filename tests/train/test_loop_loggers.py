"""The training loop's metric loggers: what each epoch's record holds, per-step loss, every
logger holding the same values as metrics.jsonl, resume (tiny runs of test_trainer_support)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer_support import N_TRAIN, make_job, make_settings

from dptrain.train.ledger import load_ledger
from dptrain.train.loop import train
from dptrain.train.loggers import CsvLogger, JsonlLogger, TensorBoardLogger


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _private_jsonl(run_dir: Path) -> list[dict]:
    path = run_dir / "private_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tensorboard(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_each_epoch_record_holds_epsilon_sigma_sample_rate_clipping_bound_and_learning_rate(
        tmp_path):
    result = train(make_job(private=True, noise_multiplier=1.3), make_settings(tmp_path))
    records = _jsonl(tmp_path)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["noise_multiplier"] == 1.3 and record["sample_rate"] == 12 / N_TRAIN
        assert record["max_grad_norm"] == 1.0 and record["lr"] == 0.1
    assert records[0]["epsilon"] < records[1]["epsilon"] < records[2]["epsilon"]
    assert records[-1]["epsilon"] == result.epsilon == load_ledger(tmp_path)["epsilon"]


def test_a_non_private_record_holds_the_learning_rate_and_no_privacy_values(tmp_path):
    train(make_job(private=False), make_settings(tmp_path, epochs=1))
    (record,) = _jsonl(tmp_path)
    assert record["lr"] == 0.1 and record["epsilon"] is None
    assert not {"noise_multiplier", "sample_rate", "max_grad_norm"} & set(record)


def test_the_step_loss_of_a_one_step_epoch_is_that_epochs_train_loss_over_all_its_chunks(
        tmp_path):
    job = make_job(private=True, batch_size=N_TRAIN)   # q = 1: one logical step per epoch
    logger = JsonlLogger(tmp_path, every_n_steps=1)
    train(job, make_settings(tmp_path, batch_size=N_TRAIN, max_physical_batch_size=16),
          loggers=[logger])
    steps = {r["step"]: r["step_loss"] for r in _private_jsonl(tmp_path) if "step_loss" in r}
    epochs = {r["step"]: r["train_loss"] for r in _private_jsonl(tmp_path) if "epoch" in r}
    assert sorted(steps) == [1, 2, 3]
    assert steps == pytest.approx(epochs, rel=1e-12)


def test_every_n_steps_logs_the_step_loss_at_its_multiples_only(tmp_path):
    logger = JsonlLogger(tmp_path, every_n_steps=5)
    train(make_job(private=False), make_settings(tmp_path), loggers=[logger])   # 12 steps
    assert [r["step"] for r in _private_jsonl(tmp_path) if "step_loss" in r] == [5, 10]


def test_tensorboard_and_csv_hold_the_values_of_metrics_jsonl(tmp_path):
    loggers = [JsonlLogger(tmp_path), TensorBoardLogger(tmp_path, private_metrics=True),
               CsvLogger(tmp_path)]
    train(make_job(private=True), make_settings(tmp_path), loggers=loggers)
    records, private = _jsonl(tmp_path), _private_jsonl(tmp_path)
    for key, tag, logged in (("train_loss", "private/train/loss", private),
                             ("test_accuracy", "test/accuracy", records),
                             ("epsilon", "privacy/epsilon", records),
                             ("sample_rate", "privacy/sample_rate", records)):
        expected = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged]
        assert _tensorboard(tmp_path, tag) == expected, tag
    with open(tmp_path / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [r["step"] for r in records]
    assert [float(row["epsilon"]) for row in rows] == [r["epsilon"] for r in records]


def test_a_run_without_loggers_still_writes_its_own_metrics_jsonl(tmp_path):
    train(make_job(private=False), make_settings(tmp_path, epochs=1), loggers=[])
    assert [r["epoch"] for r in _jsonl(tmp_path)] == [1]


def test_a_run_logging_to_tensorboard_only_still_writes_its_own_metrics_jsonl(tmp_path):
    loggers = [TensorBoardLogger(tmp_path)]
    train(make_job(private=True), make_settings(tmp_path, epochs=2), loggers=loggers)
    records = _jsonl(tmp_path)
    assert [r["epoch"] for r in records] == [1, 2]
    assert _tensorboard(tmp_path, "privacy/epsilon") == [
        (r["step"], pytest.approx(r["epsilon"], rel=1e-6)) for r in records]


def test_a_resumed_run_leaves_tensorboard_and_csv_as_an_uninterrupted_run_would(tmp_path):
    def loggers() -> list:
        return [JsonlLogger(tmp_path), TensorBoardLogger(tmp_path, private_metrics=True),
                CsvLogger(tmp_path)]

    train(make_job(private=False), make_settings(tmp_path, epochs=3), loggers=loggers())
    train(make_job(private=False),   # a new process, back at epoch 1: epochs 2 and 3 retaken
          make_settings(tmp_path, epochs=3, resume=str(tmp_path / "checkpoints" / "epoch_1.pt")),
          loggers=loggers())
    records = _private_jsonl(tmp_path)
    assert [r["step"] for r in records] == [r["step"] for r in _jsonl(tmp_path)] == [4, 8, 12]
    expected = [(r["step"], pytest.approx(r["train_loss"], rel=1e-6)) for r in records]
    assert _tensorboard(tmp_path, "private/train/loss") == expected
    for name in ("metrics.csv", "private_metrics.csv"):
        with open(tmp_path / name, newline="") as handle:
            assert [int(row["step"]) for row in csv.DictReader(handle)] == [4, 8, 12]


# What a run publishes: metrics.jsonl holds what epsilon covers, private_metrics.jsonl the rest.
PUBLISHABLE = {"epoch", "step", "final", "epsilon", "noise_multiplier", "sample_rate",
               "max_grad_norm", "lr", "test_loss", "test_accuracy", "test_perplexity"}


def test_metrics_jsonl_holds_no_training_or_validation_statistic(tmp_path):
    job = make_job(private=True, validation=True)
    train(job, make_settings(tmp_path), loggers=[JsonlLogger(tmp_path, every_n_steps=2)])
    records = _jsonl(tmp_path)
    assert records and all(set(record) <= PUBLISHABLE for record in records), records
    assert all("test_accuracy" in record and "epsilon" in record for record in records)


def test_private_metrics_jsonl_holds_training_and_validation_metrics_each_record_labelled(
        tmp_path):
    job = make_job(private=True, validation=True)
    train(job, make_settings(tmp_path), loggers=[JsonlLogger(tmp_path, every_n_steps=2)])
    records = _private_jsonl(tmp_path)
    assert all(record["private"] is True for record in records)
    epochs = [r for r in records if "epoch" in r]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    assert all({"train_loss", "train_accuracy", "val_loss", "val_accuracy"} <= set(r)
               for r in epochs)
    assert [r["step"] for r in records if "step_loss" in r] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in epochs] == [r["step"] for r in _jsonl(tmp_path)]
