"""`dptrain report` and the `logger` config group, driven through the real `dptrain` command on
tiny digits runs (in this process: fast)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dptrain.report
from dptrain_runner import QUIET, read_json, run_in_process, run_once_in_process

TINY = ["train.epochs=2", "train.batch_size=256", *QUIET]   # digits: 6 steps per epoch


def _png_ok(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and imread(path).shape[0] > 100


def _spy(monkeypatch, name: str) -> list:
    """Record the arguments of dptrain.report.<name> (the data the picture is drawn from)."""
    calls: list = []
    original = getattr(dptrain.report, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(dptrain.report, name, spy)
    return calls


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A two-job sweep over sigma (its plot is drawn at the end)."""
    folder = tmp_path_factory.mktemp("sweep")
    code, _, err = run_once_in_process(
        ["-m", "privacy=sigma", "privacy.noise_multiplier=1,2", "hydra.sweep.dir=sweep", *TINY],
        folder)
    assert code == 0, err
    return folder / "sweep"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The folder of a TINY run, `run` in it (tests that change the run copy it first)."""
    folder = tmp_path_factory.mktemp("tiny")
    code, _, err = run_once_in_process(["hydra.run.dir=run", *TINY], folder)
    assert code == 0, err
    return folder


def test_report_on_a_run_draws_metrics_jsonl_into_a_png_and_prints_a_summary(
        tiny_run, tmp_path, monkeypatch, capsys):
    shutil.copytree(tiny_run / "run", tmp_path / "run")
    drawn = _spy(monkeypatch, "plot_run")
    code, out, err = run_in_process(["report", "run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    (series, path), = [call[:2] for call in drawn]
    for key in ("test_accuracy", "epsilon"):
        assert series[key].steps == [r["step"] for r in records if key in r]
        assert series[key].values == [r[key] for r in records if key in r]
    assert Path(path) == Path("run") / "report.png" and _png_ok(tmp_path / "run/report.png")
    result = read_json(tmp_path / "run/result.json")
    assert f"{100 * result['test_accuracy']:.2f}%" in out and "epsilon: " in out


def test_a_sweep_draws_its_privacy_utility_plot_at_the_end(sweep):
    assert _png_ok(sweep / "privacy_utility.png")


def test_report_on_a_sweep_plots_one_point_per_job_from_sweep_summary(
        sweep, monkeypatch, capsys):
    drawn = _spy(monkeypatch, "plot_sweep")
    code, out, err = run_in_process(["report", str(sweep), "--output", "pu.png"], sweep.parent,
                                    monkeypatch, capsys)
    assert code == 0, err
    (points, path), = [call[:2] for call in drawn]
    rows = read_json(sweep / "sweep_summary.json")["jobs"]
    assert [(p.label, p.epsilon, p.test_accuracy) for p in points] == [
        (f"sigma = {sigma}", row["epsilon"], row["test_accuracy"])
        for sigma, row in zip((1, 2), rows)]
    assert _png_ok(sweep.parent / "pu.png")
    assert "Sweep summary" in out and "2 job(s) plotted" in out


def test_a_sweep_whose_every_job_failed_draws_no_plot_and_says_so(tmp_path, monkeypatch, capsys):
    # MNIST is not on disk (and not downloaded): every job stops before training
    _, out, _ = run_in_process(["-m", "dataset=mnist", "dataset.root=absent",
                                "privacy.noise_multiplier=1,2", "hydra.sweep.dir=sweep", *TINY],
                               tmp_path, monkeypatch, capsys)
    assert (tmp_path / "sweep" / "sweep_summary.json").is_file()
    assert not (tmp_path / "sweep" / "privacy_utility.png").exists()
    assert "no privacy-utility plot: none of its 2 job(s) finished with a test accuracy" in out


def test_report_on_a_sweep_whose_every_job_failed_draws_no_plot_and_says_so(
        tmp_path, monkeypatch, capsys):
    rows = [{"job": str(i), "overrides": [f"privacy.noise_multiplier={i + 1}"],
             "status": "failed", "epsilon": None, "test_accuracy": None} for i in range(2)]
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep_summary.json").write_text(json.dumps({"jobs": rows}))
    code, out, err = run_in_process(["report", "sweep"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "no privacy-utility plot" in out and "picture:" not in out
    assert not (tmp_path / "sweep" / "privacy_utility.png").exists()


def test_report_on_a_folder_that_is_not_a_run_says_what_it_expected(tmp_path, monkeypatch, capsys):
    code, _, err = run_in_process(["report", "."], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert "neither a run folder nor a sweep folder" in err
    assert "metrics.jsonl" in err and "sweep_summary.json" in err
    assert list(tmp_path.iterdir()) == []   # nothing written


def test_report_on_a_run_logged_to_csv_only_draws_its_metrics_jsonl(
        tmp_path, monkeypatch, capsys):
    code, _, err = run_in_process(["hydra.run.dir=run", "logger=csv", *TINY], tmp_path,
                                  monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "run/metrics.csv").exists() and (tmp_path / "run/metrics.jsonl").exists()
    code, _, err = run_in_process(["report", "run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err


def test_report_on_a_run_folder_without_metrics_jsonl_says_why(
        tiny_run, tmp_path, monkeypatch, capsys):
    shutil.copytree(tiny_run / "run", tmp_path / "run")
    (tmp_path / "run/metrics.jsonl").unlink()   # an older dptrain run logged to csv only
    code, _, err = run_in_process(["report", "run"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "has no metrics.jsonl" in err and "without the jsonl logger" in err


def test_a_logger_list_writes_metrics_jsonl_and_tensorboard_events(tmp_path, monkeypatch, capsys):
    code, _, err = run_in_process(["hydra.run.dir=run", "logger=[jsonl,tensorboard]", *TINY],
                                  tmp_path, monkeypatch, capsys)
    assert code == 0, err
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    steps = [r["step"] for r in read_json_lines(tmp_path / "run/metrics.jsonl")]
    assert [e.step for e in events.Scalars("privacy/epsilon")] == steps == [6, 12]


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_wandb_without_wandb_stops_before_training_with_the_install_command(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)   # as if wandb were not installed
    code, _, err = run_in_process(["hydra.run.dir=run", "logger=wandb", *TINY], tmp_path,
                                  monkeypatch, capsys)
    assert code == 2
    assert "logger=wandb" in err and "pip install wandb" in err
    assert not (tmp_path / "run/privacy_ledger.json").exists()   # nothing was trained


def test_a_run_resumes_with_other_loggers_than_it_started_with(tmp_path, monkeypatch, capsys):
    first = ["hydra.run.dir=run", "train.max_steps=6", *TINY]   # stopped after its first epoch
    code, _, err = run_in_process(first, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    more = ["hydra.run.dir=run", "train.resume=auto", "logger=[jsonl,csv]", *TINY]
    code, _, err = run_in_process(more, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert [r["step"] for r in read_json_lines(tmp_path / "run/metrics.jsonl")] == [6, 12]
    assert (tmp_path / "run/metrics.csv").exists()


PRIVATE_METRICS = {"train_loss", "train_accuracy", "step_loss", "val_loss", "val_accuracy"}


def test_report_on_a_run_plots_no_private_metric_by_default(tmp_path, monkeypatch, capsys):
    run = ["hydra.run.dir=run", "dataset.validation_size=0.25", "logger.jsonl.every_n_steps=3"]
    code, _, err = run_in_process([*run, *TINY], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    drawn = _spy(monkeypatch, "plot_run")
    code, out, err = run_in_process(["report", "run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    (series, _), = [call[:2] for call in drawn]
    assert {"test_accuracy", "epsilon"} <= set(series) and not PRIVATE_METRICS & set(series)
    assert "validation" not in out


def test_report_private_plots_the_private_metrics_marked_as_such(tmp_path, monkeypatch, capsys):
    run = ["hydra.run.dir=run", "dataset.validation_size=0.25", *TINY]
    code, _, err = run_in_process(run, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    drawn = _spy(monkeypatch, "plot_run")
    code, out, err = run_in_process(["report", "run", "--private"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    (series, _), = [call[:2] for call in drawn]
    assert {"train_loss", "val_accuracy", "test_accuracy"} <= set(series)
    assert "validation accuracy (private, not covered by epsilon)" in out
    assert _png_ok(tmp_path / "run/report.png")
