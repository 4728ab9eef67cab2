"""Pictures of finished runs and sweeps (no Hydra; matplotlib is imported only to draw).

A run: `run_series(records)` turns the records of its `metrics.jsonl` into one series per metric;
`plot_run` draws loss, accuracy and epsilon spent against the logical step into a PNG and
`run_summary` says the outcome in a few lines. Only what epsilon covers is drawn and said unless
`private` is asked for: then the records of `private_metrics.jsonl` (training loss and accuracy,
validation metrics) are read too, and each private curve and the figure say they are private.
A sweep: `sweep_points(summary)` takes the rows of its `sweep_summary.json` (one per job) to
(epsilon, test accuracy) points labelled by the swept values ("sigma = 1.0"), in series (one per
value of the other swept overrides); `plot_sweep` draws the privacy-utility plot, each series a
line in epsilon order, non-private jobs as horizontal baselines.
Both are drawn to be put in a paper: accuracy in percent, epsilon from 0, text of at least
FONT_SIZE points; `run_figure` and `sweep_figure` return the matplotlib Figure before it is saved.
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
from dptrain.formatting import format_epsilon
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
FONT_SIZE = 10   # points: the smallest text of a figure (tick labels, legends, notes)
TITLE_SIZE = 12
#: inches per panel of the run figure: its three panels are about a paper's text width (7 in), so
#: it is printed near its own size and its 10-point text stays readable (at 4.4 in a panel, the
#: 13-inch figure printed its text at about 5 points)
RUN_PANEL_WIDTH = 2.5
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


def run_figure(series: Mapping[str, Series], title: str = "",
               target_epsilon: float | None = None) -> Any:
    """The run's curves (PANELS: loss, accuracy in percent, epsilon spent from 0, against the
    logical step) as a matplotlib Figure; a panel with no data says so; private curves are
    marked (`curve_label`) and the title then says the figure is not to be published."""
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import offset_copy

    figure, axes = _figure(1, len(PANELS), (RUN_PANEL_WIDTH * len(PANELS), 3.8))
    private = False
    for ax, (name, keys) in zip(axes, PANELS):
        drawn = [key for key in keys if series.get(key) and series[key].steps]
        private |= not all(is_public(key) for key in drawn)
        for key in drawn:
            thin = key == "step_loss"
            ax.plot(series[key].steps, series[key].values,   # "(private)" on a line of its
                    label=curve_label(key).replace(" (", "\n("),  # own: a narrow legend
                    marker="" if thin else "o", markersize=3, linewidth=0.8 if thin else 1.5,
                    alpha=0.6 if thin else 1.0)
        if name == "epsilon spent" and target_epsilon is not None and drawn:
            ax.axhline(target_epsilon, color="grey", linestyle="--", label="target epsilon")
        if name == "epsilon spent":   # from 0, the target line below the top edge
            ax.set_ylim(0, 1.08 * ax.get_ylim()[1])
        if name == "accuracy":
            _percent_axis(ax.yaxis)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes,
                    fontsize=FONT_SIZE)
        _style(ax, name, "step")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True, min_n_ticks=1))  # no 1.975
        if drawn:   # under the panel: inside, a narrow panel's legend covered its curves
            ax.legend(fontsize=FONT_SIZE, loc="upper center", bbox_to_anchor=(0.5, 0.0),
                      bbox_transform=offset_copy(ax.transAxes, figure, y=-2.4 * (FONT_SIZE + 2),
                                                 units="points"),   # below the step label
                      frameon=False, handlelength=1.5, handletextpad=0.5)
    title = "\n".join(part for part in (title, PRIVATE_FIGURE_NOTE if private else "") if part)
    if title:
        figure.suptitle(title, fontsize=TITLE_SIZE, color="darkred" if private else "black")
    return figure


def plot_run(series: Mapping[str, Series], path: Path | str, title: str = "",
             target_epsilon: float | None = None) -> Path:
    """`run_figure` written as a PNG to `path`. Returns `path`."""
    return _save(run_figure(series, title, target_epsilon), Path(path))


def _percent_axis(axis: Any) -> None:
    """Show an axis of fractions (accuracies in [0, 1]) in percent, with the decimals its ticks
    need (ticks every half point read 94.5%, 95.0%: whole percents repeated labels)."""
    from matplotlib.ticker import PercentFormatter

    class TickPercent(PercentFormatter):
        def format_ticks(self, values: Sequence[float]) -> list[str]:
            self.decimals = tick_decimals([100 * v for v in values])
            return super().format_ticks(values)

    axis.set_major_formatter(TickPercent(xmax=1.0, decimals=0))


def tick_decimals(values: Sequence[float], most: int = 4) -> int:
    """The fewest decimals (at most `most`) that write every one of `values` exactly."""
    for decimals in range(most + 1):
        if all(abs(v * 10 ** decimals - round(v * 10 ** decimals)) < 1e-6 for v in values):
            return decimals
    return most


def _style(ax: Any, title: str, xlabel: str, ylabel: str = "") -> None:
    """Title, axis labels and tick labels of `ax` at readable sizes, and a light grid."""
    ax.set_title(title, fontsize=TITLE_SIZE)
    ax.set_xlabel(xlabel, fontsize=FONT_SIZE + 1)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=FONT_SIZE + 1)
    ax.tick_params(labelsize=FONT_SIZE)
    ax.grid(alpha=0.3)


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
        lines.append(f"epsilon: {format_epsilon(epsilon)}" + (f" at delta = {delta:g}" if delta else ""))
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
    label: str                # the swept value the line runs along, e.g. "sigma = 1"
    epsilon: float | None     # None: a non-private job (privacy=none), drawn as a baseline
    test_accuracy: float      # a fraction, in [0, 1]
    series: str = ""          # the other swept values, e.g. "learning rate = 0.1" ("": none)


# How a plot names a swept key (any other: its last part, "_" read as a space); the budget by
# its nested key and its older flat name alike.
KEY_NAMES = {
    "privacy.budget.sigma": "sigma",
    "privacy.noise_multiplier": "sigma",
    "privacy.budget.target_epsilon": "target epsilon",
    "privacy.target_epsilon": "target epsilon",
    "privacy.max_grad_norm": "C",
    "optimizer.lr": "learning rate",
}
# The swept keys that set epsilon: when one of them varies, the lines run along it.
EPSILON_KEYS = ("privacy.budget.sigma", "privacy.noise_multiplier",
                "privacy.budget.target_epsilon", "privacy.target_epsilon")


def common_overrides(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The overrides every job shares (shown once, above a table), in command-line order."""
    if not rows:
        return []
    shared = set(rows[0]["overrides"]).intersection(*(set(r["overrides"]) for r in rows[1:]))
    return [o for o in rows[0]["overrides"] if o in shared]


def _key(override: str) -> str:
    return override.partition("=")[0]


def _key_names(keys: Iterable[str]) -> dict[str, str]:
    """{key: how the plot names it}: KEY_NAMES, else the key's last part; the full keys when two
    names would be alike."""
    keys = sorted(set(keys))
    names = {k: KEY_NAMES.get(k, k.rsplit(".", 1)[-1].replace("_", " ")) for k in keys}
    return names if len(set(names.values())) == len(names) else {k: k for k in keys}


def _varying(summary: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], list[list[str]]]:
    """The jobs of a summary and, for each, the overrides that are not common to all jobs."""
    rows = list(summary.get("jobs", []))
    common = set(common_overrides(rows)) if len(rows) > 1 else set()
    return rows, [[o for o in r["overrides"] if o not in common] for r in rows]


def _along(varying: Sequence[Sequence[str]]) -> str | None:
    """The swept key each line runs along: the first varying key that sets epsilon
    (EPSILON_KEYS), else the first varying key (command-line order); None when nothing varies."""
    keys = list(dict.fromkeys(_key(o) for v in varying for o in v))
    return next((k for k in keys if k in EPSILON_KEYS), keys[0] if keys else None)


def sweep_title(summary: Mapping[str, Any]) -> str:
    """What the sweep varied, e.g. "Test accuracy against epsilon, varying sigma and learning
    rate" ("" when only one job, or nothing, varied)."""
    rows, varying = _varying(summary)
    keys = list(dict.fromkeys(_key(o) for v in varying for o in v))
    if len(rows) < 2 or not keys:
        return ""
    names = [_key_names(keys)[k] for k in keys]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"Test accuracy against epsilon, varying {listed}"


def sweep_points(summary: Mapping[str, Any]) -> list[SweepPoint]:
    """The jobs of a sweep summary (sweep_summary.json) that finished with a test accuracy, as
    points labelled by the swept value their line runs along (`_along`), in series by their
    other swept values; readable names ("sigma = 1", `_key_names`).

    A job without epsilon (privacy=none) becomes a point with epsilon None, labelled by all its
    swept values; a job with an infinite epsilon (sigma = 0) has no place on the plot and is
    left out, like failed ones and interrupted or preempted ones (their accuracy is that of an
    intermediate evaluation).
    """
    rows, varying = _varying(summary)
    along = _along(varying)
    names = _key_names(_key(o) for v in varying for o in v)

    def said(overrides: Iterable[str]) -> str:
        return ", ".join(f"{names[_key(o)]} = {o.partition('=')[2]}" for o in overrides)

    points = []
    for row, swept in zip(rows, varying):
        if (row.get("status") in ("failed", "interrupted", "preempted")
                or _number(row.get("test_accuracy")) is None
                or (row.get("epsilon") is not None and _number(row.get("epsilon")) is None)):
            continue
        epsilon = _number(row.get("epsilon"))
        on_line = [o for o in swept if _key(o) == along]
        if epsilon is None or not on_line:
            label, series = said(swept), ""
        else:
            label, series = said(on_line), said(o for o in swept if _key(o) != along)
        points.append(SweepPoint(str(row["job"]), label or str(row["job"]), epsilon,
                                 float(row["test_accuracy"]), series))
    return points


def sweep_figure(points: Sequence[SweepPoint], title: str = "", delta: float | None = None,
                 note: str = "") -> Any:
    """The privacy-utility plot as a matplotlib Figure: test accuracy (percent) against epsilon
    (from 0), each series a line through its points in epsilon order with each point labelled
    by its swept value, non-private jobs as dashed horizontal lines. `note` (what releasing the
    best job costs) is printed above the plot, wrapped."""
    figure, (ax,) = _figure(1, 1, (7.0, 5.0))
    private = [p for p in points if p.epsilon is not None]
    series = list(dict.fromkeys(p.series for p in private))
    labels = []
    for name in series:
        line = sorted((p for p in private if p.series == name), key=lambda p: p.epsilon)
        ax.plot([p.epsilon for p in line], [p.test_accuracy for p in line], marker="o",
                label=name or None, zorder=3)
        for index, point in enumerate(line):
            # below right of the point, under a rising line; above right where the line falls
            # after it (the falling segment crossed a label below)
            falls = index + 1 < len(line) and line[index + 1].test_accuracy < point.test_accuracy
            labels.append(ax.annotate(point.label, (point.epsilon, point.test_accuracy),
                                      fontsize=FONT_SIZE, textcoords="offset points",
                                      xytext=(6, 6) if falls else (6, -6),
                                      va="bottom" if falls else "top"))
    for point in points:
        if point.epsilon is None:
            ax.axhline(point.test_accuracy, color="grey", linestyle="--",
                       label=f"non-private: {point.label}")
    if not points:
        ax.text(0.5, 0.5, "no finished job with a test accuracy", ha="center", va="center",
                transform=ax.transAxes, fontsize=FONT_SIZE)
    if len(series) > 1 or any(p.epsilon is None for p in points):
        ax.legend(fontsize=FONT_SIZE)
    ax.margins(y=0.12)
    if private:   # from 0, with room for the label of the rightmost point
        ax.set_xlim(0, 1.2 * max(p.epsilon for p in private))
    _percent_axis(ax.yaxis)
    _style(ax, title, "epsilon" + (f" (delta = {delta:g})" if delta else ""), "test accuracy")
    _room_for(figure, ax, labels)
    if note:   # a line per part of the note, never a number alone on a line
        figure.suptitle("\n".join(note_lines(note, 90)), fontsize=FONT_SIZE)
    return figure


def note_lines(note: str, width: int) -> list[str]:
    """`note` (parts joined by "; ") as lines of at most `width` characters for a caption: each
    part on lines of its own, broken between words, none left short: a part's last line holds
    at least a third of `width` (a sweep's caption once ended in "(prv)" or a lone number on a
    line of its own), the lines of a part evened out instead."""
    lines = []
    for part in note.split("; "):
        wrapped = textwrap.wrap(part, width, break_on_hyphens=False)
        narrower = width
        while len(wrapped) > 1 and len(wrapped[-1]) < width // 3 and narrower > width // 2:
            narrower -= 1   # a narrower measure moves words down onto the short last line
            candidate = textwrap.wrap(part, narrower, break_on_hyphens=False)
            if len(candidate) == len(wrapped):
                wrapped = candidate
        lines += wrapped
    return lines


def _room_for(figure: Any, ax: Any, labels: Sequence[Any]) -> None:
    """Widen `ax`'s x range to the right and its y range up or down until every point label
    lies inside the axes (the rightmost point's label ran past the frame, a long one past the
    figure's edge). A label keeps its size in points, so each widening shrinks it in data
    units: a few rounds settle it."""
    for _ in range(4):
        figure.draw_without_rendering()
        frame = ax.get_window_extent()
        boxes = [label.get_window_extent() for label in labels]
        right = max([frame.x1, *(box.x1 for box in boxes)])
        bottom = min([frame.y0, *(box.y0 for box in boxes)])
        top = max([frame.y1, *(box.y1 for box in boxes)])
        if (right, bottom, top) == (frame.x1, frame.y0, frame.y1):
            return
        to_data = ax.transData.inverted()
        x_need, y_low = to_data.transform((right + 4, bottom - 4))   # 4 pixels of air
        _, y_high = to_data.transform((right, top + 4))
        ax.set_xlim(ax.get_xlim()[0], max(ax.get_xlim()[1], x_need))
        ax.set_ylim(min(ax.get_ylim()[0], y_low), max(ax.get_ylim()[1], y_high))


def plot_sweep(points: Sequence[SweepPoint], path: Path | str, title: str = "",
               delta: float | None = None, note: str = "") -> Path:
    """`sweep_figure` written as a PNG to `path`. Returns `path`."""
    return _save(sweep_figure(points, title, delta, note), Path(path))


def sweep_delta(summary: Mapping[str, Any]) -> float | None:
    """The delta every private job reports epsilon at (None when they differ or there is none)."""
    deltas = {r.get("delta") for r in summary.get("jobs", []) if r.get("delta") is not None}
    return deltas.pop() if len(deltas) == 1 else None
