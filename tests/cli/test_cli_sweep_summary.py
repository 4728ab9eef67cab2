"""The sweep summary reads every job folder of a sweep (overrides + result.json)."""

import math
from pathlib import Path

from omegaconf import OmegaConf

from dptrain.train.job import RunResult
from dptrain.cli.results import write_result
from dptrain.cli.sweep import SUMMARY_FILENAME, common_overrides, job_dirs, summarize, summary_table
from dptrain_runner import read_json
from dptrain.formatting import format_epsilon


def make_job(sweep: Path, name: str, overrides: list[str], result: RunResult | None) -> Path:
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), folder / ".hydra" / "overrides.yaml")
    if result is not None:
        write_result(folder, result, overrides)
    return folder


def done(folder_eps: float, acc: float) -> RunResult:
    return RunResult("completed", 10, 1, folder_eps, 1e-5, acc, 0.3, Path("x"))


def test_jobs_are_listed_in_numeric_order(tmp_path):
    for n in (10, 2, 1):
        make_job(tmp_path, str(n), [f"a={n}"], None)
    assert [p.name for p in job_dirs(tmp_path)] == ["1", "2", "10"]


def test_summary_has_each_jobs_overrides_epsilon_accuracy_and_status(tmp_path):
    make_job(tmp_path, "0", ["privacy.noise_multiplier=0.5"], done(4.2, 0.8))
    make_job(tmp_path, "1", ["privacy.noise_multiplier=1.0"], done(1.1, 0.7))
    summary = summarize(tmp_path)
    assert [row["overrides"] for row in summary["jobs"]] == [
        ["privacy.noise_multiplier=0.5"],
        ["privacy.noise_multiplier=1.0"],
    ]
    assert [row["epsilon"] for row in summary["jobs"]] == [4.2, 1.1]
    assert [row["test_accuracy"] for row in summary["jobs"]] == [0.8, 0.7]
    assert read_json(tmp_path / SUMMARY_FILENAME) == summary


def test_jobs_with_a_validation_split_show_their_validation_accuracy_in_summary_and_table(tmp_path):
    validated = RunResult("completed", 10, 1, 1.0, 1e-5, 0.7, 0.3, Path("x"), val_accuracy=0.65, val_loss=0.4)
    make_job(tmp_path, "0", ["dataset.validation_size=0.1"], validated)
    summary = summarize(tmp_path)
    assert summary["jobs"][0]["val_accuracy"] == 0.65 and summary["jobs"][0]["val_loss"] == 0.4
    headers = [column.header for column in summary_table(summary).columns]
    assert "val acc" in headers


def test_without_a_validation_split_the_table_has_no_validation_column(tmp_path):
    make_job(tmp_path, "0", ["x=1"], done(1.0, 0.7))
    summary = summarize(tmp_path)
    assert summary["jobs"][0]["val_accuracy"] is None
    assert "val acc" not in [column.header for column in summary_table(summary).columns]


def test_a_job_without_result_is_reported_failed(tmp_path):
    make_job(tmp_path, "0", ["x=1"], None)
    (row,) = summarize(tmp_path)["jobs"]
    assert row["status"] == "failed" and "result.json" in row["error"]


def test_an_infinite_epsilon_survives_the_json_round_trip_and_the_table(tmp_path):
    make_job(tmp_path, "0", ["privacy.noise_multiplier=0"], done(math.inf, 0.9))
    summary = summarize(tmp_path)
    table = summary_table(read_json(tmp_path / SUMMARY_FILENAME))
    assert table.row_count == 1 and summary["jobs"][0]["status"] == "completed"


def test_the_table_shows_only_the_overrides_that_vary():
    rows = [
        {"overrides": ["privacy=sigma", "privacy.noise_multiplier=0.5"]},
        {"overrides": ["privacy=sigma", "privacy.noise_multiplier=2.0"]},
    ]
    assert common_overrides(rows) == ["privacy=sigma"]


def test_the_table_fits_80_columns_and_keeps_every_column_of_every_job(tmp_path):
    from rich.console import Console

    for n, sigma in enumerate((0.5, 1.0, 2.0)):
        result = RunResult("stopped_at_budget" if n else "completed", 3525 + n, 15, 1.25 + n,
                           1e-6, 0.9012, 0.3, Path("x"), val_accuracy=0.9123, val_loss=0.2)
        make_job(tmp_path, str(n), ["+recipe=mnist_cnn", "privacy=sigma", "optimizer.lr=0.25",
                                    f"privacy.noise_multiplier={sigma}",
                                    "dataset.validation_size=0.1"], result)
    console = Console(width=80, record=True, file=open(tmp_path / "out.txt", "w"))
    console.print(summary_table(summarize(tmp_path)))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    for n in range(3):
        assert format_epsilon(1.25 + n) in text and str(3525 + n) in text
    assert text.count("91.23%") == 3 and text.count("90.12%") == 3
    overrides = "".join(line.split("│")[1].strip() for line in text.splitlines() if "│" in line)
    assert overrides == "".join(f"privacy.noise_multiplier={sigma}" for sigma in (0.5, 1.0, 2.0))


def _caption_lines(summary: dict) -> list[str]:
    from rich.console import Console

    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(summary_table(summary))
    lines = console.export_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "releasing" in line)
    return [line.strip() for line in lines[start:] if line.strip()]


def test_the_cost_caption_leaves_no_word_or_number_alone_on_a_line():
    """At 80 columns the caption ended in "(prv)" alone on a line; with few columns the table
    (and so its caption) was narrower still."""
    jobs = [{"job": str(n), "overrides": [f"privacy.noise_multiplier={s}", "train.epochs=5"],
             "status": "completed", "epsilon": e, "delta": 1e-5, "test_accuracy": 0.88,
             "steps": 60} for n, (s, e) in enumerate([(0.7, 10.5), (1, 4.98), (2, 1.6), (4, 0.671)])]
    cost = {"delta": 1e-5, "epsilon": 11.65, "selection": {"rule": "all"},
            "cost": {"all_composed": {"epsilon": 11.65, "accountant": "prv"}}}
    lines = _caption_lines({"jobs": jobs, "cost_of_best": cost})
    assert lines[0].startswith("releasing the best job costs epsilon 11.7")
    assert " ".join(lines).endswith("the 4 jobs composed (prv)")
    assert all(len(line) >= 20 for line in lines), lines
