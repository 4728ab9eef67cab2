"""`dptrain` end to end in subprocesses: the default run, every recipe on synthetic data, a sweep."""

import json
import re

import pytest
from dptrain_runner import QUIET, read_json, run_dptrain, run_in_process

from dptrain.formatting import format_epsilon
from dptrain.train.lr_schedule import LR_SCHEDULE_NOTE, LRSchedule

TINY = [
    "dataset.synthetic=true",
    "dataset.max_samples=64",
    "train.max_steps=2",
    "train.batch_size=16",
    *QUIET,
]
SMOKE = [*TINY, "train.max_physical_batch_size=8"]


def test_the_default_run_reaches_85_percent_and_prints_epsilon(tmp_path):
    result = run_dptrain([], tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    (result_file,) = tmp_path.glob("outputs/*/*/result.json")
    record = read_json(result_file)
    assert record["status"] == "completed"
    assert record["test_accuracy"] > 0.85
    assert 0 < record["epsilon"] <= 3.0 + 1e-6 and record["delta"] == 1e-5
    printed = re.search(r"epsilon = ([0-9.]+) at delta = 1e-05", result.stdout)
    # the recorded epsilon written by the one rule (3 significant digits, rounded up)
    assert printed and printed.group(1) == format_epsilon(record["epsilon"])


#: the schedule each recipe trains under: the lr_schedule group applies to every model
SCHEDULES = {"mnist_cnn": "linear", "cifar10_cnn": "cosine", "imdb_embedding": "linear",
             "imdb_lstm": "cosine", "digits_quick": "cosine"}


@pytest.mark.parametrize("recipe", list(SCHEDULES))
def test_each_recipe_trains_two_steps_on_synthetic_data_under_a_learning_rate_schedule(
        tmp_path, recipe, monkeypatch, capsys):
    """Two steps; metrics.jsonl logs the rate the schedule gives the next step, and the ledger
    records the schedule as costing no privacy."""
    code, _, err = run_in_process([f"+recipe={recipe}", f"lr_schedule={SCHEDULES[recipe]}",
                                   "hydra.run.dir=run", *SMOKE], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    record = read_json(tmp_path / "run" / "result.json")
    assert record["steps"] == 2 and record["epsilon"] > 0
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    schedule = ledger["lr_schedule"]
    assert schedule["kind"] == SCHEDULES[recipe] and schedule["privacy"] == LR_SCHEDULE_NOTE
    factor = LRSchedule(schedule["kind"], warmup_steps=schedule["warmup_steps"]).factor(
        2, schedule["total_steps"])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    base_rate = ledger["config"]["optimizer"]["lr"]
    assert json.loads(lines[-1])["lr"] == pytest.approx(base_rate * factor)


def test_a_sweep_runs_one_job_per_value_and_writes_its_summary(tmp_path, monkeypatch, capsys):
    code, out, err = run_in_process(
        [
            "-m",
            "privacy=sigma",
            "privacy.noise_multiplier=0.5,2.0",
            "hydra.sweep.dir=sweep",
            *SMOKE,
        ],
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    summary = read_json(tmp_path / "sweep" / "sweep_summary.json")
    rows = summary["jobs"]
    assert [[o for o in r["overrides"] if "noise_multiplier" in o] for r in rows] == [
        ["privacy.noise_multiplier=0.5"],
        ["privacy.noise_multiplier=2.0"],
    ]
    assert all(r["status"] == "completed" for r in rows)
    assert rows[0]["epsilon"] > rows[1]["epsilon"] > 0
    assert "Sweep summary" in out


def test_a_sweep_job_with_bad_input_is_summarized_as_failed_and_the_exit_status_is_2(
    tmp_path, monkeypatch, capsys
):
    code, _, err = run_in_process(
        ["-m", "train.max_physical_batch_size=8,32", "hydra.sweep.dir=sweep", *TINY],
        tmp_path,
        monkeypatch,
        capsys,
    )
    rows = read_json(tmp_path / "sweep" / "sweep_summary.json")["jobs"]
    assert [r["status"] for r in rows] == ["completed", "failed"]
    assert "train.max_physical_batch_size=32" in rows[1]["error"]
    assert code == 2 and "1 sweep job(s) failed" in err


def test_a_validation_split_reports_its_accuracy_privately_in_result_and_closing_line(
    tmp_path, monkeypatch, capsys
):
    code, out, err = run_in_process(
        ["hydra.run.dir=run", "dataset.validation_size=0.25", *TINY], tmp_path, monkeypatch, capsys
    )
    assert code == 0, err
    record = read_json(tmp_path / "run" / "result.json")["private"]
    assert 0.0 <= record["val_accuracy"] <= 1.0 and record["val_loss"] is not None
    assert f"(validation {100 * record['val_accuracy']:.2f}%: private, not covered" in out
