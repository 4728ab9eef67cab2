"""Each job's `result.json`: its RunResult plus the command-line overrides that made it.

Written by `dptrain` (cli/main.py) at the end of every job, read back by the sweep summary
(cli/sweep.py). Keys: status, steps, epochs_completed, epsilon, delta, test_accuracy, test_loss,
test_perplexity (a language model's; else null), run_dir, overrides (list of "key=value"), error
(the message of a job that failed, else null): values a run may publish. The last evaluation on
the validation split (`dataset.validation_size`) is held out of the private training file and
computed without noise, so epsilon does not cover it: it sits apart, in the `private` object
(`notice`, val_accuracy, val_loss, val_perplexity; null without a validation split).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dptrain.train.job import RESULT_FILENAME, RunResult
from dptrain.train.ledger import LEDGER_FILENAME
from dptrain.io import atomic_write_json

PRIVATE = "private"   # the object of result.json holding the values epsilon does not cover
PRIVATE_RESULT_KEYS = ("val_accuracy", "val_loss", "val_perplexity")
PRIVATE_NOTICE = ("NOT covered by epsilon: the last evaluation on the validation examples held "
                  "out of the private training data (dataset.validation_size), computed without "
                  "noise. Do not publish; remove this object before sharing result.json.")


def result_record(
    result: RunResult, overrides: list[str], error: str | None = None
) -> dict[str, Any]:
    """The JSON-ready record of one job: the private values in its `PRIVATE` object."""
    record = dataclasses.asdict(result)
    private = {key: record.pop(key) for key in PRIVATE_RESULT_KEYS}
    record["run_dir"] = str(result.run_dir)
    record["overrides"] = list(overrides)
    record["error"] = error
    record[PRIVATE] = {"notice": PRIVATE_NOTICE, **private}
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


def ledger_snapshot(run_dir: Path) -> bytes | None:
    """The bytes of `run_dir`'s privacy ledger (None when it has none), taken before a job."""
    try:
        return (Path(run_dir) / LEDGER_FILENAME).read_bytes()
    except OSError:
        return None


def failure_replaces_result(run_dir: Path, ledger_before: bytes | None) -> bool:
    """Whether a job that failed should write its failure to `run_dir/result.json`.

    Yes when the folder has no result yet (a new run, every sweep job) or when the failed job
    changed the run (its ledger differs from `ledger_before`: it trained, then failed). No when
    an attempt on an existing run was refused before training (a resume from another config, a
    corrupt checkpoint...): the earlier run's result.json is left as it was.
    """
    if not (Path(run_dir) / RESULT_FILENAME).exists():
        return True
    return ledger_snapshot(run_dir) != ledger_before


def read_result(run_dir: Path) -> dict[str, Any] | None:
    """The outcome of the job in `run_dir`: its result.json record with the values of its
    `private` object (the validation metrics) at the top level, as the sweep summary and the
    sweeper compare jobs by them (not covered by epsilon: never publish this dict as it is).
    None when the job left no result.json (or it is unreadable)."""
    try:
        record = json.loads((Path(run_dir) / RESULT_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    private = record.pop(PRIVATE, None)
    if isinstance(private, dict):
        record.update((k, v) for k, v in private.items() if k in PRIVATE_RESULT_KEYS)
    return record
