"""`dptrain-ledger PATH [PATH ...] [--accountant NAME] [--json]`: audit privacy ledgers.

Each PATH is a `privacy_ledger.json`, a run folder holding one, or a sweep folder (every ledger
below it is checked, and its `sweep_ledger.json`, the cost of releasing the best job, is
recomputed from the jobs' ledgers: `check_sweep_ledgers`). The table names each run by its folder, relative to the folder the runs
share (said in the title), and folds what does not fit: it fits 80 columns; its steps are those
the ledger charges (the history epsilon is computed from), and a line under the table says, for a
stopped or killed run, how many of them are not known to have finished, and why (`note` in JSON). For each ledger the epsilon is recomputed from its history with the accountant
(default: the run's) and compared with the ledger's claim, and the history is checked against the
run's other records (dptrain.train.ledger_check: checkpoint entries, resumes, metrics.jsonl,
result.json). Exit status: 0 when every ledger is readable, matches within a relative tolerance of
1e-6 and no record shows more than its history, 1 otherwise, 2 for a bad PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from dptrain.train.ledger import (
    LEDGER_FILENAME,
    Verification,
    history_from_json,
    history_steps,
    load_ledger,
    verify_ledger,
)
from dptrain.errors import DPTrainError
from dptrain.formatting import format_epsilon

RELATIVE_TOLERANCE = 1e-6


def find_ledgers(path: Path) -> list[Path]:
    """The ledger files designated by PATH (file, run folder or sweep folder), sorted."""
    if path.is_file():
        return [path]
    if (path / LEDGER_FILENAME).is_file():
        return [path / LEDGER_FILENAME]
    return sorted(path.rglob(LEDGER_FILENAME))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dptrain-ledger",
        description="Recompute epsilon from privacy ledgers and check it matches their claims.")
    parser.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                        help="a privacy_ledger.json, a run folder or a sweep folder (several: all)")
    parser.add_argument("--accountant", default=None,
                        help="accountant to recompute with (rdp, prv, gdp); default: the run's")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _check(path: Path, accountant: str | None) -> tuple[Verification, dict | None]:
    """Verify one ledger; an unreadable one becomes a failed Verification with the reason."""
    try:
        return verify_ledger(path, accountant, RELATIVE_TOLERANCE), load_ledger(path)
    except DPTrainError as err:
        return Verification(path, accountant, None, None, False, str(err)), None


def run_labels(ledgers: Sequence[Path]) -> tuple[str, list[str]]:
    """(where, labels): each ledger's run folder relative to the folder they all share (`where`,
    shown relative to the working directory); one ledger: its folder and "."."""
    from dptrain.train.display import shown_path

    folders = [path.resolve().parent for path in ledgers]
    common = Path(os.path.commonpath(folders)) if len(folders) > 1 else folders[0]
    return shown_path(common), [str(folder.relative_to(common)) for folder in folders]


def _print_table(rows: list[tuple[Verification, dict | None]]) -> None:
    from rich.console import Console
    from rich.table import Table

    where, labels = run_labels([result.path for result, _ in rows])
    table = Table(title=f"privacy ledgers in {where}", show_edge=False)
    table.add_column("run", overflow="fold", ratio=1)
    table.add_column("status", overflow="fold", min_width=len("completed"))
    for column in ("steps", "delta", "acct", "claimed", "recomputed"):
        table.add_column(column, no_wrap=True, justify="right" if column != "acct" else "left")
    table.add_column("check", overflow="fold")
    for label, (result, data) in zip(labels, rows):
        data = data or {}
        table.add_row(label, str(data.get("status", "?")).replace("_", " "),
                      charged_steps(data), str(data.get("delta", "-")),
                      str(result.accountant or "-"), _num(result.claimed), _num(result.recomputed),
                      ("[green]" if result.ok else "[red]") + result.message
                      + (" *" if result.note else ""))
    console = Console()
    console.print(table)
    for label, (result, _) in zip(labels, rows):
        if result.note:   # a stopped or killed run: what its steps column counts, and why
            console.print(f"* {label}: {result.note}.", highlight=False)


def charged_steps(data: dict) -> str:
    """The table's steps: those the ledger charges (its history: what epsilon counts, also for a
    killed run whose steps never finished), or a non-private run's steps; "?" unreadable."""
    if not data:
        return "?"
    if not data.get("private"):
        return str(data.get("steps_completed", "?"))
    return str(history_steps(history_from_json(data["history"])))


def _num(value: float | None) -> str:
    return "-" if value is None else format_epsilon(value)


# ---------------------------------------------------------------------------- sweep ledgers
def check_sweep_ledgers(paths: Sequence[Path], as_json: bool) -> list[dict]:
    """Recompute the `sweep_ledger.json` of every sweep folder in `paths` from its jobs' ledgers
    (dptrain.cli.sweep_ledger.verify_sweep_ledger); print a table of the results unless
    `as_json`. Returns the results as JSON-ready dicts (key `ok`: it matches)."""
    from dptrain.cli.sweep_ledger import SWEEP_LEDGER_FILENAME, verify_sweep_ledger
    from dptrain.io import json_safe

    folders = [path for path in paths if (path / SWEEP_LEDGER_FILENAME).is_file()]
    results = json_safe([{**asdict(verify_sweep_ledger(folder)), "kind": "sweep_ledger"}
                         for folder in folders])   # paths as strings, infinities as "inf"
    if results and not as_json:
        from rich.console import Console
        from rich.table import Table

        from dptrain.train.display import shown_path

        table = Table(title="sweep ledgers (the cost of releasing the best job)", show_edge=False)
        for column in ("sweep folder", "claimed", "recomputed", "check"):
            table.add_column(column, overflow="fold")
        for result in results:   # float(): an infinite claim reads back as "inf" (dptrain.io)
            claimed, recomputed = (None if v is None else float(v)
                                   for v in (result["claimed"], result["recomputed"]))
            table.add_row(shown_path(Path(result["path"]).parent), _num(claimed), _num(recomputed),
                          ("[green]" if result["ok"] else "[red]") + result["message"])
        Console().print(table)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dptrain-ledger` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    ledgers: list[Path] = []
    for path in args.paths:
        if not path.exists():
            print(f"dptrain-ledger: {str(path)!r} does not exist; pass a privacy_ledger.json, "
                  "a run folder or a sweep folder.", file=sys.stderr)
            return 2
        found = find_ledgers(path)
        if not found:
            print(f"dptrain-ledger: no {LEDGER_FILENAME} under {str(path)!r}.", file=sys.stderr)
            return 2
        ledgers += [p for p in found if p not in ledgers]
    rows = [_check(path, args.accountant) for path in ledgers]
    if not args.json:
        _print_table(rows)
    sweeps = check_sweep_ledgers(args.paths, args.json)
    if args.json:
        print(json.dumps([{**asdict(r), "path": str(r.path)} for r, _ in rows] + sweeps, indent=2))
    return 0 if all(r.ok for r, _ in rows) and all(s["ok"] for s in sweeps) else 1


if __name__ == "__main__":
    sys.exit(main())
