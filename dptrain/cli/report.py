"""`dptrain report PATH`: the picture and summary of a run folder or a sweep folder.

    dptrain report outputs/2026-11-22/10-00-00     # a run: report.png (curves, epsilon) + summary
    dptrain report multirun/2026-11-22/10-00-00    # a sweep: privacy_utility.png + the table
    dptrain report PATH --output figure.png        # the picture somewhere else
    dptrain report RUN --private                   # + training and validation metrics (private)

A run folder is one holding `metrics.jsonl` (its `result.json` and privacy ledger add the outcome
and the target epsilon): its report draws only what epsilon covers unless `--private` adds the
run's private metrics (`private_metrics.jsonl`: training loss and accuracy, validation), marked
private on the figure; a sweep folder one holding `sweep_summary.json`, or Hydra's
`multirun.yaml` (a sweep that did not reach its end: the summary is then written first, as at the
end of `dptrain -m`). Bad input prints one line
`dptrain report: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptrain.cli.args import OneLineParser, fail
from dptrain.errors import ConfigError, DPTrainError

PROG = "dptrain report"
MULTIRUN_FILENAME = "multirun.yaml"   # what Hydra writes at the root of every sweep folder


@dataclass(frozen=True)
class Report:
    """What `report` made: the kind of folder, the picture written and the text to print."""

    kind: str            # "run" | "sweep"
    image: Path | None   # None: nothing to draw (a sweep whose every job failed)
    text: str
    summary: dict[str, Any] | None = None   # a sweep's summary (for its table)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _not_a_report_folder(path: Path) -> ConfigError:
    from dptrain.train.ledger import LEDGER_FILENAME
    from dptrain.train.loggers import METRICS_FILENAME

    if (path / LEDGER_FILENAME).is_file():
        return ConfigError(
            f"The run folder {str(path)!r} has no {METRICS_FILENAME}, which `{PROG}` plots: the "
            "run was trained by an older dptrain without the jsonl logger (every run writes it "
            "now); open this run's logs with the tool it logged to.")
    return ConfigError(
        f"{str(path)!r} is neither a run folder nor a sweep folder: `{PROG}` expected a run "
        f"folder holding {METRICS_FILENAME} (written by every `dptrain` run; the closing line `Outputs in ...` names the folder) or a sweep folder holding "
        f"sweep_summary.json or {MULTIRUN_FILENAME} (written by `dptrain -m ...`, at "
        "hydra.sweep.dir).")


def run_report(run_dir: Path, output: Path | None = None, private: bool = False) -> Report:
    """Draw `run_dir`'s metrics.jsonl into `output` (default run_dir/report.png) and sum it up;
    with `private` its private_metrics.jsonl too (marked private)."""
    from dptrain.train.ledger import LEDGER_FILENAME
    from dptrain.cli.results import read_result
    from dptrain.report import RUN_REPORT_FILENAME, plot_run, read_metrics, run_series, run_summary

    series = run_series(read_metrics(run_dir, private), private)
    if not series:
        raise ConfigError(
            f"The run folder {str(run_dir)!r} has no metrics to plot: its metrics.jsonl is empty "
            "(the run stopped before its first epoch ended). Report it once it has logged an "
            "epoch.")
    target = ((_read_json(run_dir / LEDGER_FILENAME) or {}).get("target") or {}).get("epsilon")
    image = plot_run(series, output or run_dir / RUN_REPORT_FILENAME, title=str(run_dir),
                     target_epsilon=target)
    summary = run_summary(series, read_result(run_dir), private)
    return Report("run", image, f"run {run_dir}\n{summary}")


def sweep_report(sweep_dir: Path, output: Path | None = None) -> Report:
    """The privacy-utility plot of the sweep in `sweep_dir` (default sweep_dir/
    privacy_utility.png), from its sweep_summary.json (written first when missing); no plot
    when no job finished with a test accuracy (the text says so)."""
    from dptrain.cli.sweep import SUMMARY_FILENAME, summarize
    from dptrain.cli.sweep_ledger import describe_cost
    from dptrain.report import (
        SWEEP_REPORT_FILENAME,
        plot_sweep,
        sweep_delta,
        sweep_points,
        sweep_title,
    )

    summary = _read_json(sweep_dir / SUMMARY_FILENAME) or summarize(sweep_dir)
    points = sweep_points(summary)
    jobs = len(summary.get("jobs", []))
    if not points:
        return Report("sweep", None, f"sweep {sweep_dir}: no privacy-utility plot: none of its "
                      f"{jobs} job(s) finished with a test accuracy (the table says why).",
                      summary)
    cost = summary.get("cost_of_best")
    note = "" if cost is None else describe_cost(cost, jobs)
    image = plot_sweep(points, output or sweep_dir / SWEEP_REPORT_FILENAME,
                       title=sweep_title(summary), delta=sweep_delta(summary), note=note)
    skipped = jobs - len(points)
    text = f"sweep {sweep_dir}: {len(points)} job(s) plotted" + (
        f", {skipped} without a test accuracy or a finite epsilon left out" if skipped else "")
    return Report("sweep", image, text, summary)


def report(path: Path | str, output: Path | str | None = None, private: bool = False) -> Report:
    """The report of a run folder or a sweep folder (ConfigError naming what was expected);
    `private` adds a run's private metrics (a sweep's plot has none)."""
    from dptrain.cli.sweep import SUMMARY_FILENAME
    from dptrain.train.loggers import METRICS_FILENAME

    path = Path(path)
    out = Path(output) if output is not None else None
    if not path.is_dir():
        raise ConfigError(f"{str(path)!r} is not a folder: `{PROG}` takes a run folder or a "
                          "sweep folder.")
    if (path / SUMMARY_FILENAME).is_file() or (path / MULTIRUN_FILENAME).is_file():
        return sweep_report(path, out)
    if (path / METRICS_FILENAME).is_file():
        return run_report(path, out, private)
    raise _not_a_report_folder(path)


def write_sweep_plot(sweep_dir: Path) -> Path | None:
    """The privacy-utility plot at the end of a sweep; None when there is nothing to draw (said
    on stdout) or it cannot be drawn (no matplotlib, said on stderr): the sweep itself has
    succeeded."""
    try:
        made = sweep_report(sweep_dir)
    except DPTrainError as error:
        sys.stderr.write(f"{PROG}: no privacy-utility plot: {' '.join(str(error).split())}\n")
        return None
    if made.image is None:
        print(made.text, flush=True)
    return made.image


class _OneLineParser(OneLineParser):
    program = PROG


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Plot a run (loss, accuracy, epsilon over "
                            "steps) or a sweep (test accuracy against epsilon, one point per job).")
    parser.add_argument("path", type=Path, help="a run folder or a sweep folder")
    parser.add_argument("--output", "-o", type=Path, default=None,
                        help="where to write the PNG (default: report.png in a run folder, "
                             "privacy_utility.png in a sweep folder)")
    parser.add_argument("--private", action="store_true",
                        help="a run folder: also draw its private metrics (training loss and "
                             "accuracy, validation metrics, from private_metrics.jsonl), which "
                             "epsilon does not cover; the figure says so (do not publish it)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`dptrain report PATH [--output FILE] [--private]`; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        made = report(args.path, args.output, args.private)
    except DPTrainError as error:
        fail(PROG, str(error))
    if made.summary is not None:
        from rich.console import Console

        from dptrain.cli.sweep import summary_table

        Console().print(summary_table(made.summary))
    print(made.text)
    if made.image is not None:
        print(f"picture: {made.image}")
    return 0
