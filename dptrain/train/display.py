"""The run's console output: progress while it trains and evaluates, and the closing summary.

On a terminal (with `train.progress`) each epoch and each long evaluation gets a rich progress
bar. Otherwise (a log file, a cluster job, `train.progress=false`) the run says the same in
lines of text through the `dptrain.train` logger (the command's console and `main.log`): one line
per epoch (loss, accuracy, evaluation, epsilon so far, seconds) and, while a phase runs longer
than `PROGRESS_EVERY_S`, a line of its progress at most that often. `note` is the run's one
channel for such lines (resumes, interrupts).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dptrain.train.evaluation import Tally
from dptrain.train.job import RunResult
from dptrain.errors import DPTrainError
from dptrain.train.ledger import PRIVACY_UNIT, PrivacyLedger
from dptrain.train.ledger.verification import ledger_accountant
from dptrain.formatting import format_epsilon

log = logging.getLogger("dptrain.train")

PROGRESS_EVERY_S = 10.0   # without bars: a phase longer than this reports its progress this often
EPSILON_EVERY_S = 1.0     # with bars: the epsilon spent so far is recomputed at most this often

# How the noise and the batch sampling are seeded (the ledger's mechanism.randomness), as the
# summary says it.
RANDOMNESS_SUMMARY = {
    "os_entropy": "noise and sampling seeded from OS entropy (unpredictable, not reproducible)",
    "secure": "secure mode (every draw from the OS CSPRNG)",
    "reproducible": "noise and sampling REPRODUCIBLE from a seed: epsilon is not a guarantee if "
                    "the seed is known",
}
# How the console labels the statistics of the private data that epsilon does not cover.
PRIVATE_LABEL = "private (not covered by epsilon)"
SYNTHETIC_NOTE = "SYNTHETIC random data (dataset.synthetic=true): accuracy means nothing"


def note(message: str) -> None:
    """One line of the run's progress or state (INFO on the `dptrain.train` logger)."""
    log.info(message)


@contextlib.contextmanager
def visible_notes() -> Iterator[None]:
    """Make `note` lines reach stdout when nothing else would show them (a Python script that
    configured no logging); the command's logging (console and main.log) is left as it is."""
    if logging.getLogger().handlers or log.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def shown_path(path: Path | str) -> str:
    """`path` relative to the working directory when it lies below it, else as given."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve())) or "."
    except (ValueError, OSError):
        return str(path)


class _Every:
    """True at most every `seconds` once `seconds` have passed since it was made."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Display:
    """Progress bars (terminal) or progress lines (otherwise), and the final summary table."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console

        self.console = Console()
        self.enabled = enabled and self.console.is_terminal   # rich bars
        self._progress: Any = None
        self._task: Any = None
        self._lines: _Every | None = None
        self._label = ""
        self._total: int | None = None
        self._done = 0
        self._epsilon_due = _Every(0.0)

    # -- training ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def epoch(self, epoch: int, epochs: int, total: int | None) -> Iterator[None]:
        """Progress of epoch `epoch` (0-based) of `epochs`, `total` steps (None: unknown)."""
        self._label, self._total, self._done = f"epoch {epoch + 1}/{epochs}", total, 0
        if not self.enabled:
            self._lines = _Every(PROGRESS_EVERY_S)
            try:
                yield
            finally:
                self._lines = None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (TextColumn(self._label), BarColumn(), MofNCompleteColumn(),
                   TextColumn("private loss {task.fields[loss]} acc {task.fields[acc]} "
                              "eps {task.fields[eps]}"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=False) as progress:
            self._progress = progress
            self._epsilon_due = _Every(EPSILON_EVERY_S)
            self._task = progress.add_task("train", total=total, loss="-", acc="-", eps="-")
            yield
        self._progress = None

    def advance(self, tally: Tally, epsilon: Callable[[], float | None]) -> None:
        """One logical step done: `tally` of the epoch so far; `epsilon()` is the epsilon of
        the steps taken so far (not of the block committed ahead of them), asked for only when
        shown: at most every EPSILON_EVERY_S on a bar, on each progress line."""
        self._done += 1
        if self._progress is not None:
            shown = {"eps": _epsilon(epsilon())} if self._epsilon_due.due() else {}
            self._progress.update(self._task, advance=1, loss=_fmt(tally.loss),
                                  acc=_fmt(tally.accuracy), **shown)
        elif self._lines is not None and self._lines.due():
            of = "" if self._total is None else f"/{self._total}"
            note(f"{self._label}: step {self._done}{of}, private loss {_fmt(tally.loss)}, "
                 f"epsilon so far {_epsilon(epsilon())}, {self._lines.elapsed():.0f} s")

    def epoch_line(self, label: str, record: dict[str, Any], seconds: float) -> None:
        """Without bars: one line for an epoch's metrics `record` (a metrics record, before its
        split): the private values (training loss and accuracy, validation) labelled so."""
        if self.enabled:
            return
        private = [f"loss {_fmt(record['train_loss'])}"] if "train_loss" in record else []
        if record.get("train_accuracy") is not None:
            private.append(f"accuracy {_percent(record['train_accuracy'])}")
        public = []
        for split, name, parts in (("val", "validation", private), ("test", "test", public)):
            if record.get(f"{split}_accuracy") is not None:
                parts.append(f"{name} accuracy {_percent(record[f'{split}_accuracy'])}")
            if record.get(f"{split}_perplexity") is not None:
                parts.append(f"{name} perplexity {_fmt(record[f'{split}_perplexity'])}")
        epsilon = record.get("epsilon")
        public.append("no privacy" if epsilon is None else f"epsilon so far {_epsilon(epsilon)}")
        shown = [f"{PRIVATE_LABEL}: {', '.join(private)};"] if private else []
        note(f"{label}: {' '.join([*shown, ', '.join(public)])}, {seconds:.1f} s")

    # -- evaluation ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def evaluation(self, split: str, total: int | None) -> Iterator[Callable[[], None]]:
        """Progress of evaluating `split` over `total` batches: yields the per-batch callback. A
        transient bar on a terminal; otherwise a line every PROGRESS_EVERY_S seconds."""
        done = [0]
        if not self.enabled:
            every = _Every(PROGRESS_EVERY_S)

            def line() -> None:
                done[0] += 1
                if every.due():
                    of = "" if total is None else f"/{total}"
                    note(f"evaluating the {split} split: batch {done[0]}{of}, "
                         f"{every.elapsed():.0f} s")

            yield line
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn(f"evaluating the {split} split"), BarColumn(),
                      MofNCompleteColumn(), console=self.console, transient=True) as progress:
            task = progress.add_task("eval", total=total)
            yield lambda: progress.advance(task)

    # -- the end -------------------------------------------------------------------------------
    def summary(self, result: RunResult, ledger: PrivacyLedger) -> None:
        """The closing table: where the run is, what it reached, what it spent."""
        from rich.table import Table

        table = Table(title=f"dptrain run: {result.status}", show_header=False)
        table.add_column(no_wrap=True)
        table.add_column(overflow="fold")
        table.add_row("run folder", shown_path(result.run_dir))
        table.add_row("steps / epochs", f"{result.steps} / {result.epochs_completed}")
        untrained = (result.steps_charged or 0) - result.steps
        if untrained > 0:
            table.add_row("steps charged", f"{result.steps_charged}: {untrained} more than the "
                          "model trained, taken by earlier processes of this run and not "
                          "retaken (a resume from an older checkpoint, or steps committed before "
                          "a crash); every step that touched the data stays charged")
        dataset = ledger.data["dataset"]
        if dataset.get("synthetic"):
            table.add_row("dataset", f"{dataset['name']}: {SYNTHETIC_NOTE}")
        if result.val_accuracy is not None:
            table.add_row("validation loss / accuracy", f"{_fmt(result.val_loss)} / "
                          f"{_fmt(result.val_accuracy)} ({PRIVATE_LABEL})")
        table.add_row("test loss / accuracy", f"{_fmt(result.test_loss)} / {_fmt(result.test_accuracy)}")
        if result.test_perplexity is not None or result.val_perplexity is not None:
            validation = "" if result.val_perplexity is None else f" ({PRIVATE_LABEL})"
            table.add_row("test / validation perplexity",
                          f"{_fmt(result.test_perplexity)} / {_fmt(result.val_perplexity)}"
                          f"{validation}")
        if ledger.private:
            for label, value in privacy_rows(ledger):
                table.add_row(label, value)
        else:
            table.add_row("privacy", ledger.data["note"])
        table.add_row("ledger", shown_path(ledger.path))
        self.console.print(table)


def privacy_rows(ledger: PrivacyLedger) -> list[tuple[str, str]]:
    """The summary's privacy rows of a private ledger: epsilon under the run's accountant, under
    each other one (a looser bound exceeding the target is explained), the unit, how the noise
    and the sampling are seeded."""
    data = ledger.data
    name, target = data["accountant"], data["target"]["epsilon"]
    rows = [(f"epsilon ({name})", f"{_epsilon(ledger.epsilon)} at delta={data['delta']:g} "
                                  f"({_guarantee(data, name)})"),
            ("mechanism", mechanism_summary(data["mechanism"])),
            ("privacy unit", data["mechanism"].get("privacy_unit", PRIVACY_UNIT))]
    for other, claim in sorted(data["epsilon_by_accountant"].items()):
        if other == name:
            continue
        value = f"{_epsilon(claim['epsilon'])} ({_guarantee(data, other)})"
        if (not claim["approximate"] and target is not None and claim["epsilon"] is not None
                and float(claim["epsilon"]) > target):
            value += (f": above the target {target:g}, a looser bound than {name}'s, the "
                      f"accountant the run is calibrated and capped with")
        rows.append((f"  epsilon under {other}", value))
    randomness = data["mechanism"].get("randomness")
    if randomness in RANDOMNESS_SUMMARY:
        rows.append(("randomness", RANDOMNESS_SUMMARY[randomness]))
    return rows


def mechanism_summary(mechanism: dict[str, Any]) -> str:
    """The ledger's mechanism in a line: how batches are drawn, how they are clipped and noised
    (banded noise with cyclic Poisson must not read as plain DP-SGD)."""
    sampling = f"{mechanism.get('sampling', '?')} sampling"
    if mechanism.get("sample_rate") is not None:
        sampling += f" (q = {float(mechanism['sample_rate']):.4g})"
    norm = mechanism.get("max_grad_norm")
    bound = "per-layer bounds" if isinstance(norm, list) else f"C = {_fmt(norm)}"
    return (f"{mechanism.get('algorithm', 'DP-SGD')}: {sampling}, {mechanism.get('clipping', '?')} "
            f"clipping at {bound}, {mechanism.get('noise', 'gaussian')} noise with sigma = "
            f"{_fmt(mechanism.get('noise_multiplier'))}")


def _guarantee(data: dict[str, Any], accountant: str) -> str:
    """What the ledger's claim under `accountant` is (the `guarantee` of the accountant charging
    its plan's steps under that name: a shuffle's or balls-in-bins' own); "?" for a name no
    longer registered."""
    try:
        return ledger_accountant(data, accountant).guarantee
    except DPTrainError:
        return "?"


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    return f"{float(value):.4g}"


def _epsilon(value: float | str | None) -> str:
    """An epsilon spent (an upper bound): rounded up (dptrain.formatting); "-" when unknown."""
    return "-" if value is None else format_epsilon(value)


def _percent(value: float) -> str:
    return f"{100 * float(value):.2f}%"

