"""Each job's `result.json`: its RunResult plus the command-line overrides that made it.

Written by `dptrain` (cli/main.py) at the end of every job, read back by the sweep summary
(cli/sweep.py). Keys: status, steps, epochs_completed, epsilon, delta, test_accuracy, test_loss,
run_dir, overrides (list of "key=value"), error (the message of a job that failed, else null).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dptrain.cli.job import RunResult
from dptrain.io import atomic_write_json

RESULT_FILENAME = "result.json"


def result_record(
    result: RunResult, overrides: list[str], error: str | None = None
) -> dict[str, Any]:
    """The JSON-ready record of one job."""
    record = dataclasses.asdict(result)
    record["run_dir"] = str(result.run_dir)
    record["overrides"] = list(overrides)
    record["error"] = error
    return record


def failed_result(run_dir: Path) -> RunResult:
    """The RunResult of a job stopped by an error before or during training."""
    return RunResult(
        status="failed",
        steps=0,
        epochs_completed=0,
        epsilon=None,
        delta=None,
        test_accuracy=None,
        test_loss=None,
        run_dir=run_dir,
    )


def write_result(
    run_dir: Path, result: RunResult, overrides: list[str], error: str | None = None
) -> Path:
    """Write `run_dir/result.json` atomically and return its path."""
    path = Path(run_dir) / RESULT_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result_record(result, overrides, error))
    return path


def read_result(run_dir: Path) -> dict[str, Any] | None:
    """The record in `run_dir/result.json`, or None when the job left none (or it is unreadable)."""
    try:
        return json.loads((Path(run_dir) / RESULT_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
