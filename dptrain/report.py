"""Pictures of finished runs and sweeps (no Hydra; matplotlib is imported only to draw).

A run: `run_series(records)` turns the records of its `metrics.jsonl` into one series per metric;
`plot_run` draws loss, accuracy and epsilon spent against the logical step into a PNG and
`run_summary` says the outcome in a few lines. Only what epsilon covers is drawn and said unless
`private` is asked for: then the records of `private_metrics.jsonl` (training loss and accuracy,
validation metrics) are read too, and each private curve and the figure say they are private.
A sweep: `sweep_points(summary)` takes the rows of its `sweep_summary.json` (one per job) to
(epsilon, test accuracy) points labelled by the swept values; `plot_sweep` draws the
privacy-utility plot, non-private jobs as horizontal baselines.
`dptrain report PATH` (dptrain.cli.report) finds these files and calls these functions.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.io import JsonLines, atomic_write_bytes
from dptrain.train.loggers import (
    METRICS_FILENAME,
    PRIVATE_METRICS_FILENAME,
    is_public,
    scalars,
)

RUN_REPORT_FILENAME = "report.png"
SWEEP_REPORT_FILENAME = "privacy_utility.png"
PRIVATE_FIGURE_NOTE = ("PRIVATE metrics drawn (marked private): not covered by epsilon, do not "
                       "publish this figure")
# The run plot's panels: title and the record keys drawn in it.
PANELS = (
    ("loss", ("train_loss", "step_loss", "val_loss", "test_loss")),
    ("accuracy", ("train_accuracy", "val_accuracy", "test_accuracy")),
    ("epsilon spent", ("epsilon",)),
)


@dataclass(frozen=True)
class Series:
    """One metric over a run: `values[i]` after logical step `steps[i]` (steps increasing)."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def read_metrics(run_dir: Path | str, private: bool = False) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl`, then with `private` those of
    `private_metrics.jsonl` (a torn last line skipped; [] without the files)."""
    names = (METRICS_FILENAME, PRIVATE_METRICS_FILENAME) if private else (METRICS_FILENAME,)
    return [record for name in names for record in JsonLines(Path(run_dir) / name).records()]


def run_series(records: Iterable[Mapping[str, Any]], private: bool = False) -> dict[str, Series]:
    """{metric: Series} of every numeric field of the records but step, epoch, time and final;
    only the metrics a run may publish (`is_public`) unless `private` (a run written before the
    metrics were split holds its training loss in metrics.jsonl: left out too).

    Records without a `step` are skipped; a metric logged twice at one step keeps its last
    value (the final record repeats epsilon; a resumed run re-logs its resume step).
    """
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key, value in scalars(record).items():
            if key not in ("step", "epoch") and (private or is_public(key)):
                by_key.setdefault(key, {})[step] = value
    return {key: Series(sorted(points), [points[s] for s in sorted(points)])
            for key, points in by_key.items()}


def _figure(rows: int, cols: int, size: tuple[float, float]) -> Any:
    """A matplotlib Figure with its axes (no pyplot: no global backend or window)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError("Drawing a report needs the `matplotlib` package, which is not "
                          "installed: run `pip install matplotlib` (or "
                          "`pip install 'dptrain[loggers]'`).") from error
    figure = Figure(figsize=size, layout="constrained")
    return figure, figure.subplots(rows, cols, squeeze=False)[0]


def _save(figure: Any, path: Path) -> Path:
    """Write `figure` as a PNG to `path` atomically."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def curve_label(key: str) -> str:
    """A curve's legend: the metric's name, "(private)" after a metric epsilon does not cover."""
    return key if is_public(key) else f"{key} (private)"


def plot_run(series: Mapping[str, Series], path: Path | str, title: str = "",
             target_epsilon: float | None = None) -> Path:
    """The run's curves (PANELS: loss, accuracy, epsilon spent, against the logical step) as a
    PNG at `path`; a panel with no data says so; private curves are marked (`curve_label`) and
    the title then says the figure is not to be published. Returns `path`."""
    figure, axes = _figure(1, len(PANELS), (4.2 * len(PANELS), 3.4))
    private = False
    for ax, (name, keys) in zip(axes, PANELS):
        drawn = [key for key in keys if series.get(key) and series[key].steps]
        private |= not all(is_public(key) for key in drawn)
        for key in drawn:
            thin = key == "step_loss"
            ax.plot(series[key].steps, series[key].values, label=curve_label(key),
                    marker="" if thin else "o", markersize=3, linewidth=0.8 if thin else 1.5,
                    alpha=0.6 if thin else 1.0)
        if name == "epsilon spent" and target_epsilon is not None and drawn:
            ax.axhline(target_epsilon, color="grey", linestyle="--", label="target epsilon")
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
    title = "\n".join(part for part in (title, PRIVATE_FIGURE_NOTE if private else "") if part)
    if title:
        figure.suptitle(title, fontsize="medium", color="darkred" if private else "black")
    return _save(figure, Path(path))


def _number(value: Any) -> float | None:
    """A finite float, or None (null, a string such as "inf", a non-number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _percent(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else f"{100 * number:.2f}%"


def run_summary(series: Mapping[str, Series], result: Mapping[str, Any] | None = None,
                private: bool = False) -> str:
    """A few lines on a run: outcome, accuracy, epsilon and the mechanism's last sigma / q / C;
    with `private` also the validation accuracy, labelled private.

    `result` is the run's outcome (dptrain.cli.results.read_result; None while it runs or after
    a crash: the values then come from the last logged ones)."""
    result = result or {}

    def last(key: str) -> float | None:
        found = series.get(key)
        return found.values[-1] if found and found.values else None

    steps = result.get("steps", max((s.steps[-1] for s in series.values() if s.steps), default=0))
    lines = [f"status: {result.get('status', 'no result.json (running, or stopped)')}, "
             f"{steps} steps"]
    accuracy = result.get("test_accuracy", last("test_accuracy"))
    lines.append(f"test accuracy: {_percent(accuracy)}")
    validation = result.get("val_accuracy", last("val_accuracy"))
    if private and validation is not None:
        lines.append(f"validation accuracy (private, not covered by epsilon): "
                     f"{_percent(validation)}")
    epsilon = result.get("epsilon", last("epsilon"))
    if epsilon is None:
        lines.append("epsilon: none (not a private run)")
    else:
        delta = result.get("delta")
        lines.append(f"epsilon: {epsilon:.4g}" + (f" at delta = {delta:g}" if delta else ""))
    mechanism = [f"{name} {last(key):.4g}" for key, name in
                 (("noise_multiplier", "sigma"), ("sample_rate", "sample rate"),
                  ("max_grad_norm", "clipping bound"), ("lr", "learning rate"))
                 if last(key) is not None]
    if mechanism:
        lines.append("last logged: " + ", ".join(mechanism))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sweeps
@dataclass(frozen=True)
class SweepPoint:
    """One sweep job on the privacy-utility plot."""

    job: str                  # its folder, relative to the sweep folder
    label: str                # the values the sweep varied, e.g. "noise_multiplier=1"
    epsilon: float | None     # None: a non-private job (privacy=none), drawn as a baseline
    test_accuracy: float


def common_overrides(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The overrides every job shares (shown once, above a table), in command-line order."""
    if not rows:
        return []
    shared = set(rows[0]["overrides"]).intersection(*(set(r["overrides"]) for r in rows[1:]))
    return [o for o in rows[0]["overrides"] if o in shared]


def _short(override: str) -> str:
    """"privacy.noise_multiplier=1" -> "noise_multiplier=1" (the key's last part)."""
    key, sep, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}{sep}{value}"


def _key(override: str) -> str:
    return override.partition("=")[0]


def sweep_points(summary: Mapping[str, Any]) -> list[SweepPoint]:
    """The jobs of a sweep summary (sweep_summary.json) that finished with a test accuracy, as
    points labelled by their varying overrides (short keys, unless two keys end alike).

    A job without epsilon (privacy=none) becomes a point with epsilon None; a job with an
    infinite epsilon (sigma = 0) has no place on the plot and is left out, like failed ones and
    interrupted or preempted ones (their accuracy is that of an intermediate evaluation).
    """
    rows = list(summary.get("jobs", []))
    common = set(common_overrides(rows)) if len(rows) > 1 else set()
    usable = [r for r in rows if r.get("status") not in ("failed", "interrupted", "preempted")
              and _number(r.get("test_accuracy")) is not None
              and (r.get("epsilon") is None or _number(r.get("epsilon")) is not None)]
    varying = [[o for o in r["overrides"] if o not in common] for r in usable]
    keys = {_key(o) for v in varying for o in v}
    unique = len({_key(_short(k)) for k in keys}) == len(keys)   # no two keys end alike
    labels = [", ".join(_short(o) if unique else o for o in v) for v in varying]
    return [SweepPoint(str(r["job"]), label or str(r["job"]), _number(r.get("epsilon")),
                       float(r["test_accuracy"]))
            for r, label in zip(usable, labels)]


def plot_sweep(points: Sequence[SweepPoint], path: Path | str, title: str = "",
               delta: float | None = None, note: str = "") -> Path:
    """The privacy-utility plot: test accuracy against epsilon, one labelled point per job,
    non-private jobs as dashed horizontal lines, written as a PNG to `path`. Returns `path`.
    `note` (what releasing the best job costs) is printed above the plot, wrapped."""
    figure, (ax,) = _figure(1, 1, (6.4, 4.4))
    private = sorted((p for p in points if p.epsilon is not None), key=lambda p: p.epsilon)
    if private:
        ax.scatter([p.epsilon for p in private], [p.test_accuracy for p in private],
                   color="tab:blue", zorder=3)
        for i, point in enumerate(private):   # neighbours' labels above / below their points
            ax.annotate(point.label, (point.epsilon, point.test_accuracy), fontsize="small",
                        textcoords="offset points", xytext=(4, 5 if i % 2 == 0 else -12))
        epsilons = [p.epsilon for p in private]
        if min(epsilons) > 0 and max(epsilons) / min(epsilons) > 20:
            ax.set_xscale("log")
    for point in points:
        if point.epsilon is None:
            ax.axhline(point.test_accuracy, color="grey", linestyle="--",
                       label=f"non-private: {point.label}")
    if not points:
        ax.text(0.5, 0.5, "no finished job with a test accuracy", ha="center", va="center",
                transform=ax.transAxes)
    if any(p.epsilon is None for p in points):
        ax.legend(fontsize="small")
    ax.margins(x=0.2, y=0.1)   # room for the labels of the outermost points
    ax.set_xlabel("epsilon" + (f" (delta = {delta:g})" if delta else ""))
    ax.set_ylabel("test accuracy")
    ax.set_title(title or "privacy-utility", fontsize="medium")
    if note:
        figure.suptitle("\n".join(textwrap.wrap(note, 80)), fontsize="small")
    ax.grid(alpha=0.3)
    return _save(figure, Path(path))


def sweep_delta(summary: Mapping[str, Any]) -> float | None:
    """The delta every private job reports epsilon at (None when they differ or there is none)."""
    deltas = {r.get("delta") for r in summary.get("jobs", []) if r.get("delta") is not None}
    return deltas.pop() if len(deltas) == 1 else None
