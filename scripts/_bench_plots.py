"""Figures in the style of the Opacus paper (matplotlib optional).

- Figure 2 style: full-epoch runtime (s, log) against batch size (log), one panel per model, one
  line per method; configurations that ran out of memory or time are left out of their line.
- Figure 4 style: cumulative runtime over the epochs (s) at one batch size, one panel per model.
Epoch times are scaled to a full epoch of the real dataset when ``--steps-per-epoch`` shortened
them (a line above the panels says so).
"""

import importlib.util
import math
from itertools import accumulate
from pathlib import Path

MATPLOTLIB_MISSING = "matplotlib is not installed (pip install matplotlib)"


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():  # noqa: ANN202 - matplotlib is optional, so no type at import time
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


FONT_SIZE = 9   # points: the smallest text (ticks, legend), readable at a paper's text width
PANEL_SIZE = (3.4, 2.7)   # inches: two panels side by side fill a paper's text width (~7 in)


def _panels(models: list[str]):  # noqa: ANN202
    """One panel per model, two to a row: the figure is at most ~7 inches wide, so it is printed
    near its own size and its text stays >= FONT_SIZE points (a row of four panels was 17 inches
    wide: its 7-point legend printed at about 3 points)."""
    plt = _pyplot()
    cols = min(2, len(models))
    rows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows),
                             squeeze=False, layout="constrained")
    for ax in axes.flat[len(models):]:   # an odd number of models: the last cell stays empty
        ax.set_visible(False)
    return plt, fig, list(axes.flat[:len(models)])


def _axes_text(ax, title: str, xlabel: str, ylabel: str, first_column: bool) -> None:  # noqa: ANN001
    """Title and axis labels at readable sizes; the y label only on the first column (the
    panels of a row share it)."""
    ax.set_title(title, fontsize=FONT_SIZE + 1)
    ax.set_xlabel(xlabel, fontsize=FONT_SIZE)
    if first_column:
        ax.set_ylabel(ylabel, fontsize=FONT_SIZE)
    ax.tick_params(labelsize=FONT_SIZE)
    ax.grid(alpha=0.3, which="both")


def _plain_log_axis(axis, values: list[float] | None = None) -> None:  # noqa: ANN001
    """A log axis labelled in plain numbers: ticks at `values` (the batch sizes run: "16",
    not "2^4"), or at 1, 2 and 5 times the powers of ten ("200", not "2 x 10^2"); no labels on
    the minor ticks (they overlapped the major ones)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(FixedLocator(values) if values else LogLocator(10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def finished_records(records: list[dict]) -> list[dict]:
    """The records a figure can plot: configurations that ran and have an epoch time."""
    return [r for r in records if r["status"] == "ok" and r["full_epoch_estimate_s"]]


EXTRAPOLATED_NOTE = "epoch times extrapolated to the full dataset from shortened epochs"


def _extrapolated(records: list[dict]) -> bool:
    return any(r["steps_per_epoch"] < r["dataset_steps_per_epoch"] for r in records)


def _legend(fig, axes: list, records: list[dict]) -> None:  # noqa: ANN001
    """One legend for every panel, below them (inside a panel it covered lines), and a line
    above them when the epoch times were extrapolated (the y label was too long to fit).
    No legend when nothing ran."""
    for ax in axes:
        if ax.get_lines():
            handles, labels = ax.get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)),
                       fontsize=FONT_SIZE, frameon=False)
            break
    if _extrapolated(records):
        fig.suptitle(EXTRAPOLATED_NOTE, fontsize=FONT_SIZE)


def _save(plt, fig, path: Path) -> Path:  # noqa: ANN001
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def runtime_figure(records: list[dict], models: list[str], methods: list[str], path: Path) -> Path:
    """Figure 2: median epoch runtime vs batch size, log-log, one panel per model."""
    plt, fig, axes = _panels(models)
    done = finished_records(records)
    for index, (ax, model) in enumerate(zip(axes, models)):
        batches: set[int] = set()
        for method in methods:
            points = sorted((r["batch_size"], r["full_epoch_estimate_s"]) for r in done
                            if r["model"] == model and r["method"] == method)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=4, label=method)
                batches.update(b for b, _ in points)
        ax.set(xscale="log", yscale="log")
        _plain_log_axis(ax.xaxis, sorted(batches))
        _plain_log_axis(ax.yaxis)
        _axes_text(ax, model, "batch size", "median epoch time (s)", index % 2 == 0)
    _legend(fig, axes, records)
    return _save(plt, fig, path)


def cumulative_figure(
    records: list[dict], models: list[str], methods: list[str], batch_size: int, path: Path
) -> Path:
    """Figure 4: cumulative runtime after each epoch at ``batch_size``, one panel per model."""
    plt, fig, axes = _panels(models)
    from matplotlib.ticker import MaxNLocator

    for index, (ax, model) in enumerate(zip(axes, models)):
        for r in finished_records(records):
            if r["model"] == model and r["batch_size"] == batch_size and r["method"] in methods:
                scale = r["dataset_steps_per_epoch"] / r["steps_per_epoch"]
                totals = list(accumulate(t * scale for t in r["epoch_times_s"]))
                ax.plot(range(1, len(totals) + 1), totals, marker=".", label=r["method"])
        ax.set(yscale="log")
        _plain_log_axis(ax.yaxis)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # whole epochs
        _axes_text(ax, f"{model}, B = {batch_size}", "epoch",
                   "cumulative time (s)", index % 2 == 0)
    _legend(fig, axes, records)
    return _save(plt, fig, path)


def default_cumulative_batch(batch_sizes: list[int]) -> int:
    """The batch size closest (in log scale) to 256, the paper's usual setting."""
    return min(batch_sizes, key=lambda b: abs(math.log2(b) - 8))
