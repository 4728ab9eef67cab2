"""The sweep summary: after `dptrain -m ...`, one table, `sweep_summary.json` and the
privacy-utility plot `privacy_utility.png` (`dptrain report`) at the sweep root.

`SweepSummaryCallback` is registered in the primary config under `hydra.callbacks`; Hydra calls
its `on_multirun_end` in the launching process once every job has finished, whatever the launcher
(basic, joblib, submitit). It reads each job folder's `.hydra/overrides.yaml` and `result.json`
(a job with no result.json is reported as failed) from the file system, so it works the same when
the jobs ran in other processes or on other machines. The summary also says what releasing the
best job costs (every job trained on the same data: dptrain.cli.sweep_ledger, which writes
`sweep_ledger.json` next to it): under `cost_of_best`, in the table's caption and on the plot.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from dptrain.cli.results import read_result
from dptrain.cli.sweep_ledger import SWEEP_LEDGER_FILENAME, describe_cost, write_sweep_ledger
from dptrain.formatting import format_epsilon
from dptrain.io import atomic_write_json
from dptrain.report import common_overrides, note_lines

SUMMARY_FILENAME = "sweep_summary.json"
COLUMNS = (
    "status", "epsilon", "delta", "val_accuracy", "val_loss", "test_accuracy", "test_loss", "steps"
)
# The table's columns (summary key -> header), kept narrow so that the table fits 80 columns.
TABLE_COLUMNS = {"status": "status", "epsilon": "epsilon", "delta": "delta",
                 "val_accuracy": "val acc", "test_accuracy": "test acc", "steps": "steps"}


def _natural_key(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every job folder under `sweep_dir` (those holding `.hydra/overrides.yaml`), in job order."""
    found = {
        p.parent.parent for p in sweep_dir.rglob("overrides.yaml") if p.parent.name == ".hydra"
    }
    found.discard(sweep_dir)
    return sorted(found, key=lambda p: _natural_key(p.relative_to(sweep_dir)))


def job_row(sweep_dir: Path, job_dir: Path) -> dict[str, Any]:
    """One summary row: the job's folder, overrides, status, epsilon, accuracy..."""
    overrides = [str(o) for o in OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")]
    record = read_result(job_dir) or {"status": "failed", "error": "the job wrote no result.json"}
    row: dict[str, Any] = {"job": str(job_dir.relative_to(sweep_dir)), "overrides": overrides}
    row.update({key: record.get(key) for key in COLUMNS})
    row["error"] = record.get("error")
    return row


def summarize(sweep_dir: Path) -> dict[str, Any]:
    """The summary of the sweep in `sweep_dir` (also written to sweep_summary.json there)."""
    sweep_dir = Path(sweep_dir)
    rows = [job_row(sweep_dir, d) for d in job_dirs(sweep_dir)]
    ledger = write_sweep_ledger(sweep_dir)
    cost_of_best = {key: ledger[key] for key in ("epsilon", "delta", "selection", "cost")}
    summary = {"sweep_dir": str(sweep_dir), "jobs": rows, "cost_of_best": cost_of_best}
    atomic_write_json(sweep_dir / SUMMARY_FILENAME, summary)
    return summary


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key == "status":
        return str(value).replace("_", " ")   # stopped at budget: wraps between words
    if key.endswith("accuracy") and isinstance(value, (int, float)):
        return f"{100 * value:.2f}%"
    if key == "epsilon":
        return format_epsilon(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


#: characters of a caption line of the sweep table: it fits 80 columns, and rich's own wrapping
#: at the table's width (which left "(prv)" alone on a line) never has to break one
CAPTION_WIDTH = 72


def summary_table(summary: dict[str, Any]) -> Table:
    """A rich table that fits 80 columns: one row per job with the overrides that vary (folded
    when long), status, epsilon, accuracy; what every job shares (overrides, delta) in the
    caption. The sweep folder is printed apart (`SweepSummaryCallback`)."""
    rows = summary["jobs"]
    common = common_overrides(rows) if len(rows) > 1 else []
    shared = [f"all jobs: {' '.join(common)}"] if common else []
    keys = [k for k in TABLE_COLUMNS if any(r.get(k) is not None for r in rows)
            or k not in ("val_accuracy", "delta")]   # val acc only with a validation split
    deltas = {r.get("delta") for r in rows}
    if len(rows) > 1 and len(deltas) == 1 and None not in deltas:
        keys.remove("delta")
        shared.append(f"delta {_cell(deltas.pop(), 'delta')}")
    caption = "; ".join(shared)
    cost = summary.get("cost_of_best")
    if cost is not None:   # on lines of its own, none left with a word or a number alone
        caption = "\n".join(filter(None, [caption, *note_lines(describe_cost(cost, len(rows)),
                                                                CAPTION_WIDTH)]))
    table = Table(title="Sweep summary", caption=caption or None, show_edge=False,
                  min_width=CAPTION_WIDTH)   # never narrower than its caption lines
    table.add_column("job", no_wrap=True)
    table.add_column("overrides", overflow="fold", ratio=1)
    for key in keys:
        table.add_column(TABLE_COLUMNS[key], overflow="fold",
                         justify="left" if key == "status" else "right")
    for row in rows:
        varying = [o for o in row["overrides"] if o not in common]
        table.add_row(row["job"], " ".join(varying) or "-", *(_cell(row.get(k), k) for k in keys))
    return table


class SweepSummaryCallback(Callback):
    """Hydra callback: at the end of a multirun, writes sweep_summary.json, prints the table and
    draws the privacy-utility plot (dptrain.cli.report)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        if sweep_dir.is_dir():
            finish_sweep(sweep_dir)


def finish_sweep(sweep_dir: Path) -> dict[str, Any]:
    """The end of a sweep (`dptrain -m`, `dptrain tune`): write sweep_summary.json and
    sweep_ledger.json, print the table and draw the privacy-utility plot; returns the summary."""
    summary = summarize(sweep_dir)
    from dptrain.train.display import shown_path

    console = Console()
    console.print(summary_table(summary))
    console.print(f"Summary written to {shown_path(sweep_dir / SUMMARY_FILENAME)}, the cost of "
                  f"releasing the best job to {shown_path(sweep_dir / SWEEP_LEDGER_FILENAME)}")
    from dptrain.cli.report import write_sweep_plot

    image = write_sweep_plot(sweep_dir)
    if image is not None:
        console.print(f"Privacy-utility plot written to {shown_path(image)}")
    return summary
