"""The run's records against its ledger's history: no record may show more than the history.

A ledger's epsilon is recomputed from its `history` (dptrain.train.ledger.verify_ledger), so a
history shortened by hand, with its counts and epsilons recomputed, would verify on its own. The
run left other records of the steps it took, and each shows a step count (logical steps, or steps
charged) and often the epsilon spent then:

* the ledger's checkpoint entries (`checkpoints`, and the summary of the entries of files no longer
  on disk, `pruned_checkpoints`) and its resumes (`step` + `charged_steps`);
* `metrics.jsonl` in the ledger's folder, one line per evaluation (`step`, `epsilon`);
* `result.json` in the ledger's folder (`steps`, `epsilon`).

The history always holds every step a record shows (steps are committed before they run and never
leave the history, resumes included), and epsilon only grows with the history, so a record showing
more steps, or an epsilon larger than the history's, means the history was cut: `record_mismatches`
names each such record. Checkpoint files are not read (they are not parsed to check a ledger).

What this cannot detect: the ledger is not signed. Whoever edits every record consistently (or
deletes the files beside the ledger) is not detected; only records the editor missed are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.formatting import format_epsilon
from dptrain.io import JsonLines
from dptrain.train.job import RESULT_FILENAME
from dptrain.train.loggers import METRICS_FILENAME

# A record's epsilon may exceed the history's by this much (relative) before it counts as a
# mismatch: records are epsilons of the history's prefixes, equal to it at the last step, and a
# ledger written by a version whose accountant numerics differ slightly is the claim check's
# concern (verify_ledger), not an edit of the history.
EPSILON_TOLERANCE = 1e-3


@dataclass(frozen=True)
class RunRecord:
    """One record of the run: where it is, the steps it shows, the epsilon it shows (None: no
    epsilon recorded there)."""

    where: str
    steps: int
    epsilon: float | None


def _number(value: Any) -> float | None:
    """A recorded epsilon as a float ("inf" strings of dptrain.io included); None when absent or
    not a number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _steps(value: Any) -> int | None:
    """A recorded step count; None when absent or not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def checkpoint_records(data: dict[str, Any]) -> Iterator[RunRecord]:
    """The ledger's checkpoint entries, and the summary of the pruned ones."""
    for entry in data.get("checkpoints", []):
        yield RunRecord(f"checkpoint entry {entry['path']}", int(entry["step"]),
                        _number(entry.get("epsilon")))
    pruned = data.get("pruned_checkpoints")
    if pruned and pruned["count"]:
        yield RunRecord(f"pruned_checkpoints ({pruned['count']} entries)", int(pruned["max_step"]),
                        _number(pruned.get("max_epsilon")))


def ledger_records(data: dict[str, Any]) -> Iterator[RunRecord]:
    """The ledger's own records of steps: its checkpoint records, and its resumes (the resume
    step plus the steps it kept charged)."""
    yield from checkpoint_records(data)
    for number, resume in enumerate(data.get("resumes", []), start=1):
        step, charged = _steps(resume.get("step")), _steps(resume.get("charged_steps")) or 0
        if step is not None:
            yield RunRecord(f"resume {number} (step {step} + {charged} charged steps)",
                            step + charged, None)


def newest_checkpoint_step(data: dict[str, Any]) -> int:
    """The largest step of any checkpoint the ledger says was written, pruned ones included."""
    return max((record.steps for record in checkpoint_records(data)), default=0)


def folder_records(run_dir: Path) -> Iterator[RunRecord]:
    """The records beside the ledger: each metrics.jsonl line with a step, and result.json (a
    file that is absent or unreadable shows nothing)."""
    lines = JsonLines(Path(run_dir) / METRICS_FILENAME).records()
    for number, line in enumerate(lines, start=1):
        steps = _steps(line.get("step"))
        if steps is not None:
            yield RunRecord(f"{METRICS_FILENAME} line {number}", steps,
                            _number(line.get("epsilon")))
    try:
        result = json.loads((Path(run_dir) / RESULT_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    steps = _steps(result.get("steps")) if isinstance(result, dict) else None
    if steps is not None:
        yield RunRecord(RESULT_FILENAME, steps, _number(result.get("epsilon")))


def record_mismatches(run_dir: Path, data: dict[str, Any], steps: int,
                      epsilon: float) -> list[str]:
    """Every record of the run (the ledger `data`'s, and those in `run_dir`) that shows more than
    `steps` steps or an epsilon above `epsilon` (the history's, by more than EPSILON_TOLERANCE),
    each as "<record>: step S, epsilon E > history: T steps, epsilon H"; [] when none does."""
    found = []
    for record in [*ledger_records(data), *folder_records(run_dir)]:
        beyond = record.steps > steps or (
            record.epsilon is not None and record.epsilon > epsilon * (1 + EPSILON_TOLERANCE))
        if beyond:  # 6 digits: two close epsilons told apart
            shown = "" if record.epsilon is None else f", epsilon {format_epsilon(record.epsilon, 6)}"
            found.append(f"{record.where}: step {record.steps}{shown} > history: {steps} steps, "
                         f"epsilon {format_epsilon(epsilon, 6)}")
    return found


def first_mismatch(mismatches: list[str]) -> str:
    """The first of `record_mismatches` and how many more there are, for a one-line message."""
    more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    return mismatches[0] + more


def edited_ledger_error(path: Path, mismatches: list[str]) -> ConfigError:
    """The refusal to trust the ledger at `path` whose records show more than its history."""
    return ConfigError(
        f"The privacy ledger {str(path)!r} holds a history that the run's own records exceed: "
        f"{first_mismatch(mismatches)}. Its history was shortened or edited, so the epsilon it gives "
        "would under-count what the run released, and the run cannot be resumed from it. Restore "
        "the ledger the run wrote (`dptrain-ledger` on the run folder names every record it "
        "contradicts), or start a new run in a new folder (hydra.run.dir). Nothing was changed.")
