"""Metric loggers (dptrain.train.loggers): what each writes, resume, options, missing packages."""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dptrain.errors import ConfigError
from dptrain.train.loggers import (
    CsvLogger,
    JsonlLogger,
    MetricLogger,
    MetricLoggers,
    MlflowLogger,
    TensorBoardLogger,
    WandbLogger,
    learning_rates,
    make_logger,
    make_loggers,
)

EPOCH_1 = {"epoch": 1, "train_loss": 1.5, "epsilon": 0.5, "noise_multiplier": 1.1, "time": 7.0}
EPOCH_2 = {"epoch": 2, "train_loss": 1.25, "test_accuracy": 0.75, "epsilon": 0.8, "time": 8.0}


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_jsonl_logger_writes_one_line_per_record_epoch_then_step_then_the_metrics(tmp_path):
    logger = JsonlLogger(tmp_path)
    logger.log(12, EPOCH_1)
    logger.log(24, {**EPOCH_2, "final": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 12, **EPOCH_1},
                                                    {"step": 24, **EPOCH_2, "final": True}]
    assert list(json.loads(lines[0]))[:2] == ["epoch", "step"]


def test_jsonl_resume_drops_the_records_after_the_resume_step(tmp_path):
    JsonlLogger(tmp_path).log(12, EPOCH_1)
    JsonlLogger(tmp_path).log(24, EPOCH_2)
    JsonlLogger(tmp_path).resume_at(12)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [12]


def test_csv_logger_writes_a_row_per_record_and_widens_its_header_for_new_keys(tmp_path):
    logger = CsvLogger(tmp_path)
    logger.log(12, EPOCH_1)
    logger.log(13, {"step_loss": None})
    logger.log(24, EPOCH_2)
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["12", "13", "24"]
    assert float(rows[0]["train_loss"]) == 1.5 and rows[0]["test_accuracy"] == ""
    assert rows[1]["step_loss"] == "" and float(rows[2]["test_accuracy"]) == 0.75
    assert list(rows[0]) == ["step", *EPOCH_1, "step_loss", "test_accuracy"]


def test_csv_resume_keeps_the_rows_up_to_the_resume_step(tmp_path):
    CsvLogger(tmp_path).log(12, EPOCH_1)
    CsvLogger(tmp_path).log(24, EPOCH_2)
    resumed = CsvLogger(tmp_path)
    resumed.resume_at(12)
    resumed.log(24, {**EPOCH_2, "train_loss": 9.0})
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert [(r["step"], float(r["train_loss"])) for r in rows] == [("12", 1.5), ("24", 9.0)]


def test_tensorboard_logger_writes_grouped_scalars_that_the_event_reader_reads_back(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log(12, EPOCH_1)
    logger.log(24, {**EPOCH_2, "final": True})
    logger.close()
    scalars = _tensorboard_scalars(tmp_path)
    assert scalars["train/loss"] == [(12, 1.5), (24, 1.25)]
    assert scalars["privacy/epsilon"] == [(12, 0.5), (24, pytest.approx(0.8))]
    assert scalars["test/accuracy"] == [(24, 0.75)]
    assert scalars["privacy/noise_multiplier"] == [(12, pytest.approx(1.1))]
    assert "time" not in scalars and "final" not in scalars


def test_tensorboard_resume_hides_the_events_after_the_resume_step(tmp_path):
    first = TensorBoardLogger(tmp_path)
    first.log(12, EPOCH_1)
    first.log(24, EPOCH_2)
    first.close()
    resumed = TensorBoardLogger(tmp_path)
    resumed.resume_at(12)
    resumed.log(24, {"train_loss": 9.0})
    resumed.close()
    assert _tensorboard_scalars(tmp_path)["train/loss"] == [(12, 1.5), (24, 9.0)]


def test_tensorboard_opens_no_event_file_before_its_first_record(tmp_path):
    TensorBoardLogger(tmp_path).close()
    assert list(tmp_path.iterdir()) == []


class _FakeWandbRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", step, data))

    def finish(self) -> None:
        self.calls.append(("finish",))


def _fake_wandb(monkeypatch) -> list:
    calls: list = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or _FakeWandbRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_logger_runs_offline_in_the_run_folder_unless_configured(monkeypatch, tmp_path):
    calls = _fake_wandb(monkeypatch)
    logger = WandbLogger(tmp_path)
    logger.log_config({"optimizer": {"lr": 0.1}})
    logger.log(12, EPOCH_1)
    logger.close()
    (_, init), (_, step, data), finish = calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert init["config"] == {"optimizer": {"lr": 0.1}}
    assert step == 12 and data == {"epoch": 1.0, "train/loss": 1.5, "privacy/epsilon": 0.5,
                                   "privacy/noise_multiplier": 1.1}
    assert finish == ("finish",)


def test_wandb_mode_must_be_offline_online_or_disabled(monkeypatch, tmp_path):
    _fake_wandb(monkeypatch)
    with pytest.raises(ConfigError, match="logger.wandb.mode"):
        WandbLogger(tmp_path, mode="cloud")


class _FakeMlflowClient:
    instances: list[_FakeMlflowClient] = []

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri, self.calls = tracking_uri, []
        _FakeMlflowClient.instances.append(self)

    def get_experiment_by_name(self, name: str) -> None:
        return None

    def create_experiment(self, name: str) -> str:
        self.calls.append(("experiment", name))
        return "7"

    def create_run(self, experiment_id: str, run_name: str | None = None) -> Any:
        self.calls.append(("run", experiment_id))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

    def log_param(self, run_id: str, key: str, value: str) -> None:
        self.calls.append(("param", key, value))

    def log_metric(self, run_id: str, key: str, value: float, step: int) -> None:
        self.calls.append(("metric", key, value, step))

    def set_terminated(self, run_id: str) -> None:
        self.calls.append(("terminated", run_id))


def test_mlflow_logger_tracks_into_the_run_folder_by_default(monkeypatch, tmp_path):
    module = types.ModuleType("mlflow")
    module.tracking = types.SimpleNamespace(MlflowClient=_FakeMlflowClient)
    monkeypatch.setitem(sys.modules, "mlflow", module)
    _FakeMlflowClient.instances.clear()
    logger = MlflowLogger(tmp_path)
    logger.log_config({"optimizer": {"lr": 0.1}})
    logger.log(24, EPOCH_2)
    logger.close()
    (client,) = _FakeMlflowClient.instances
    assert client.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()
    assert client.tracking_uri.startswith("file://")
    assert ("param", "optimizer.lr", "0.1") in client.calls
    assert ("metric", "test/accuracy", 0.75, 24) in client.calls
    assert client.calls[-1] == ("terminated", "r1")


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                           ("tensorboard", "tensorboard")])
def test_a_missing_logger_package_is_a_config_error_naming_the_pip_command(
        monkeypatch, tmp_path, name, package):
    monkeypatch.setitem(sys.modules, package, None)   # `import package` now fails
    with pytest.raises(ConfigError, match=f"pip install {package}`") as caught:
        make_logger(name, tmp_path)
    assert f"logger={name}" in str(caught.value)


def test_an_unknown_logger_or_option_is_a_config_error_naming_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="jsonl, tensorboard, csv, wandb, mlflow"):
        make_logger("neptune", tmp_path)
    with pytest.raises(ConfigError, match="logger.csv.every_n_step .*every_n_steps"):
        make_logger("csv", tmp_path, {"every_n_step": 2})


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_every_n_steps_must_be_an_integer_at_least_zero(tmp_path, value):
    with pytest.raises(ConfigError, match="logger.jsonl.every_n_steps"):
        make_logger("jsonl", tmp_path, {"every_n_steps": value})


def test_make_loggers_builds_the_configured_loggers_in_order(tmp_path):
    loggers = make_loggers({"csv": {"every_n_steps": 3}, "jsonl": None}, tmp_path)
    assert [type(lg) for lg in loggers] == [CsvLogger, JsonlLogger]
    assert loggers[0].every_n_steps == 3


class _Recorder(MetricLogger):
    def __init__(self, every_n_steps: int = 0, fail_on_close: bool = False,
                 private_metrics: bool | None = None) -> None:
        super().__init__(every_n_steps, private_metrics)
        self.records: list = []
        self.closed, self.fail_on_close = False, fail_on_close

    def log(self, step: int, metrics: Any) -> None:
        self.records.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True
        if self.fail_on_close:
            raise OSError("disk full")


def test_step_metrics_go_only_to_the_loggers_whose_every_n_steps_divides_the_step():
    every_2 = _Recorder(every_n_steps=2, private_metrics=True)
    epochs_only = _Recorder(private_metrics=True)
    loggers = MetricLoggers([every_2, epochs_only])
    for step in (1, 2, 3, 4):
        if loggers.step_due(step):
            loggers.log_step(step, {"step_loss": float(step)})
    loggers.log(4, EPOCH_1)
    assert [s for s, _ in every_2.records] == [2, 4, 4, 4]   # step loss; epoch 1: public, private
    assert [s for s, _ in epochs_only.records] == [4, 4]
    assert not MetricLoggers([epochs_only]).step_due(4)


def test_a_logger_gets_the_private_metrics_only_with_private_metrics_and_under_private():
    public_only, with_private = _Recorder(), _Recorder(private_metrics=True)
    MetricLoggers([public_only, with_private]).log(4, EPOCH_1)
    public = {"epoch": 1, "epsilon": 0.5, "noise_multiplier": 1.1}
    assert public_only.records == [(4, public)]
    assert with_private.records == [(4, public),
                                    (4, {"private/train_loss": 1.5, "private/time": 7.0})]


def test_tensorboard_names_the_private_metrics_under_private_and_drops_their_wall_clock(
        tmp_path):
    MetricLoggers([TensorBoardLogger(tmp_path, private_metrics=True)]).log(12, EPOCH_1)
    assert set(_tensorboard_scalars(tmp_path)) == {
        "epoch", "privacy/epsilon", "privacy/noise_multiplier", "private/train/loss"}


def test_every_n_steps_without_private_metrics_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="logger.tensorboard.private_metrics=true"):
        make_logger("tensorboard", ".", {"every_n_steps": 5})


def test_only_the_loggers_keeping_private_metrics_in_a_file_of_their_own_take_them_by_default(
        tmp_path):
    taken = {name: make_logger(name, tmp_path).private_metrics for name in ("jsonl", "csv",
                                                                           "tensorboard")}
    assert taken == {"jsonl": True, "csv": True, "tensorboard": False}
    assert not WandbLogger.PRIVATE_BY_DEFAULT and not MlflowLogger.PRIVATE_BY_DEFAULT


def test_csv_writes_the_private_metrics_to_private_metrics_csv_marked_private(tmp_path):
    MetricLoggers([CsvLogger(tmp_path)]).log(12, EPOCH_1)
    (public,) = _csv_rows(tmp_path / "metrics.csv")
    (private,) = _csv_rows(tmp_path / "private_metrics.csv")
    assert set(public) == {"step", "epoch", "epsilon", "noise_multiplier"}
    assert private == {"step": "12", "private": "True", "epoch": "1", "train_loss": "1.5",
                       "time": "7.0"}


def test_every_logger_is_closed_and_a_close_failure_never_hides_the_run_error():
    failing, other = _Recorder(fail_on_close=True), _Recorder()
    with pytest.raises(ValueError, match="the run's error"):
        with MetricLoggers([failing, other]):
            raise ValueError("the run's error")
    assert failing.closed and other.closed


def test_a_close_failure_after_a_clean_run_is_raised_once_every_logger_is_closed():
    failing, other = _Recorder(fail_on_close=True), _Recorder()
    with pytest.raises(OSError, match="disk full"):
        with MetricLoggers([failing, other]):
            pass
    assert other.closed


def test_learning_rates_one_key_for_a_shared_rate_one_per_group_otherwise():
    assert learning_rates([{"lr": 0.1}, {"lr": 0.1}]) == {"lr": 0.1}
    assert learning_rates([{"lr": 0.1}, {"lr": 0.01}]) == {"lr_0": 0.1, "lr_1": 0.01}
    assert learning_rates([{"params": []}]) == {}
