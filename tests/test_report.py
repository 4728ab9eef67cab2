"""Report rendering (dptrain.report): the series and points that go into the pictures, the PNGs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from dptrain.errors import ConfigError
from dptrain.report import (
    SweepPoint,
    curve_label,
    plot_run,
    plot_sweep,
    run_figure,
    run_series,
    run_summary,
    sweep_delta,
    sweep_figure,
    sweep_points,
    sweep_title,
)

RECORDS = [
    {"epoch": 1, "step": 12, "train_loss": 2.0, "train_accuracy": 0.4, "epsilon": 2.0,
     "time": 1.0, "test_loss": 1.9, "test_accuracy": 0.7},
    {"step": 15, "step_loss": 1.8},
    {"epoch": 2, "step": 24, "train_loss": 1.5, "train_accuracy": 0.7, "epsilon": 3.0,
     "noise_multiplier": 1.1, "time": 2.0},
    {"epoch": 2, "step": 24, "final": True, "test_loss": 1.4, "test_accuracy": 0.8,
     "epsilon": 3.0, "time": 3.0},
]


def _row(job: str, overrides: list[str], epsilon, accuracy, status: str = "completed") -> dict:
    return {"job": job, "overrides": overrides, "status": status, "epsilon": epsilon,
            "delta": None if epsilon is None else 1e-5, "test_accuracy": accuracy}


# A sweep of two learning rates x two sigmas (command-line order: lr first).
GRID = {"jobs": [_row(str(i), ["privacy=sigma", f"optimizer.lr={lr}",
                               f"privacy.noise_multiplier={sigma}"], epsilon, accuracy)
                 for i, (lr, sigma, epsilon, accuracy) in enumerate(
                     [(0.1, 1, 2.7, 0.80), (0.1, 2, 0.8, 0.70),
                      (0.5, 1, 2.7, 0.85), (0.5, 2, 0.8, 0.60)])]}


def _texts(figure) -> list:
    """Every piece of text the figure shows (tick labels included: the figure is laid out)."""
    from matplotlib.text import Text

    figure.draw_without_rendering()
    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def test_run_series_has_one_series_per_logged_metric_by_step():
    series = run_series(RECORDS, private=True)
    assert set(series) == {"train_loss", "train_accuracy", "epsilon", "test_loss",
                           "test_accuracy", "step_loss", "noise_multiplier"}
    assert (series["train_loss"].steps, series["train_loss"].values) == ([12, 24], [2.0, 1.5])
    assert (series["test_accuracy"].steps, series["test_accuracy"].values) == ([12, 24], [0.7, 0.8])
    assert (series["step_loss"].steps, series["step_loss"].values) == ([15], [1.8])
    assert series["epsilon"].steps == [12, 24]   # the final record repeats step 24's epsilon


def test_run_series_keeps_the_last_value_logged_at_a_step():
    series = run_series([{"step": 5, "epsilon": 1.0}, {"step": 5, "epsilon": 0.5}])
    assert series["epsilon"].values == [0.5]


def test_run_series_leaves_out_the_private_metrics_unless_asked_even_from_an_older_metrics_file():
    series = run_series(RECORDS + [{"step": 24, "val_accuracy": 0.6, "private": True}])
    assert set(series) == {"epsilon", "test_loss", "test_accuracy", "noise_multiplier"}
    assert {"train_loss", "val_accuracy"} <= set(run_series(RECORDS + [
        {"step": 24, "val_accuracy": 0.6, "private": True}], private=True))


def test_a_private_curve_is_labelled_private_and_a_public_one_is_not():
    assert curve_label("val_accuracy") == "val_accuracy (private)"
    assert curve_label("train_loss") == "train_loss (private)"
    assert curve_label("test_accuracy") == "test_accuracy"


def test_run_summary_says_the_validation_accuracy_only_when_asked_and_labels_it_private():
    result = {"status": "completed", "steps": 24, "test_accuracy": 0.8, "val_accuracy": 0.7}
    assert "validation" not in run_summary(run_series(RECORDS), result)
    assert ("validation accuracy (private, not covered by epsilon): 70.00%"
            in run_summary(run_series(RECORDS), result, private=True))


def test_run_series_skips_non_numbers_and_records_without_a_step():
    series = run_series([{"train_loss": 1.0}, {"step": 3, "epsilon": "inf", "final": True}])
    assert series == {}


def test_run_summary_states_outcome_accuracy_epsilon_and_the_mechanism():
    result = {"status": "completed", "steps": 24, "test_accuracy": 0.8, "epsilon": 3.0,
              "delta": 1e-5, "val_accuracy": None}
    text = run_summary(run_series(RECORDS), result)
    assert "completed, 24 steps" in text and "test accuracy: 80.00%" in text
    assert "epsilon: 3.00 at delta = 1e-05" in text and "sigma 1.1" in text


def test_run_summary_without_a_result_uses_the_last_logged_values():
    text = run_summary(run_series(RECORDS))
    assert "24 steps" in text and "80.00%" in text and "epsilon: 3.00" in text


def test_plot_run_writes_a_png(tmp_path):
    _assert_png(plot_run(run_series(RECORDS), tmp_path / "run.png", "run", target_epsilon=3.0))


def test_sweep_points_are_labelled_by_readable_names_of_the_overrides_that_vary():
    summary = {"jobs": [_row("0", ["privacy=sigma", "privacy.noise_multiplier=1"], 2.7, 0.75),
                        _row("1", ["privacy=sigma", "privacy.noise_multiplier=2"], 0.8, 0.66)]}
    assert sweep_points(summary) == [SweepPoint("0", "sigma = 1", 2.7, 0.75),
                                     SweepPoint("1", "sigma = 2", 0.8, 0.66)]


def test_a_sweep_over_the_nested_budget_keys_is_labelled_and_run_along_like_the_flat_ones():
    summary = {"jobs": [_row("0", ["optimizer.lr=0.1", "privacy.budget.sigma=1"], 2.7, 0.75),
                        _row("1", ["optimizer.lr=0.2", "privacy.budget.sigma=2"], 0.8, 0.66)]}
    assert [(p.label, p.series) for p in sweep_points(summary)] == [
        ("sigma = 1", "learning rate = 0.1"), ("sigma = 2", "learning rate = 0.2")]


def test_sweep_points_keep_full_keys_when_short_names_would_collide():
    summary = {"jobs": [_row("0", ["model.width=1", "optimizer.width=2"], 1.0, 0.5),
                        _row("1", ["model.width=2", "optimizer.width=1"], 2.0, 0.6)]}
    assert [(p.label, p.series) for p in sweep_points(summary)] == [
        ("model.width = 1", "optimizer.width = 2"), ("model.width = 2", "optimizer.width = 1")]


def test_sweep_points_run_along_sigma_in_one_series_per_value_of_the_other_swept_key():
    points = sweep_points(GRID)
    assert [(p.label, p.series) for p in points] == [
        (f"sigma = {sigma}", f"learning rate = {lr}") for lr in (0.1, 0.5) for sigma in (1, 2)]


def test_sweep_title_says_what_varies():
    assert sweep_title(GRID) == "Test accuracy against epsilon, varying learning rate and sigma"
    assert sweep_title({"jobs": [_row("0", ["privacy.noise_multiplier=1"], 1.0, 0.5)]}) == ""


def test_sweep_points_leave_out_failed_and_infinite_jobs_and_keep_non_private_ones():
    summary = {"jobs": [_row("0", ["a=1"], 1.0, 0.5),
                        _row("1", ["a=2"], None, None, status="failed"),
                        _row("2", ["a=3"], "inf", 0.9),
                        _row("3", ["privacy=none"], None, 0.95)]}
    points = sweep_points(summary)
    assert [(p.job, p.epsilon) for p in points] == [("0", 1.0), ("3", None)]


def test_sweep_points_leave_out_interrupted_jobs_whose_accuracy_is_an_intermediate_one():
    summary = {"jobs": [_row("0", ["a=1"], 1.0, 0.5),
                        _row("1", ["a=2"], 0.3, 0.4, status="interrupted")]}
    assert [p.job for p in sweep_points(summary)] == ["0"]


def test_sweep_points_leave_out_preempted_jobs_whose_accuracy_is_an_intermediate_one():
    summary = {"jobs": [_row("0", ["a=1"], 1.0, 0.5),
                        _row("1", ["a=2"], 0.3, 0.4, status="preempted")]}
    assert [p.job for p in sweep_points(summary)] == ["0"]


def test_sweep_delta_is_the_delta_every_private_job_shares():
    assert sweep_delta({"jobs": [_row("0", [], 1.0, 0.5), _row("1", [], None, 0.6)]}) == 1e-5
    assert sweep_delta({"jobs": [{"delta": 1e-5}, {"delta": 1e-6}]}) is None


def test_plot_sweep_writes_a_png_with_private_points_and_a_non_private_baseline(tmp_path):
    points = [SweepPoint("0", "noise_multiplier=1", 2.7, 0.75),
              SweepPoint("1", "privacy=none", None, 0.9)]
    _assert_png(plot_sweep(points, tmp_path / "sweep.png", delta=1e-5))


def test_the_sweep_figure_draws_each_series_as_a_line_in_epsilon_order():
    (ax,) = sweep_figure(sweep_points(GRID)).axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines == {"learning rate = 0.1": ([0.8, 2.7], [0.70, 0.80]),
                     "learning rate = 0.5": ([0.8, 2.7], [0.60, 0.85])}
    assert {t.get_text() for t in ax.texts} == {"sigma = 1", "sigma = 2"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)


def test_the_sweep_figure_shows_accuracy_in_percent_and_epsilon_from_zero():
    from matplotlib.ticker import PercentFormatter

    (ax,) = sweep_figure(sweep_points(GRID), title=sweep_title(GRID), delta=1e-5).axes
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] > 2.7
    formatter = ax.yaxis.get_major_formatter()
    assert isinstance(formatter, PercentFormatter) and formatter(0.8, 0) == "80%"
    assert ax.get_title() == sweep_title(GRID) and ax.get_xlabel() == "epsilon (delta = 1e-05)"


def test_the_sweep_figure_keeps_the_cost_note_above_the_plot():
    note = "Releasing the best of these 4 jobs costs epsilon 5.1 at delta 1e-05, not 2.7."
    figure = sweep_figure(sweep_points(GRID), note=note)
    assert " ".join(figure.get_suptitle().split()) == note


def test_every_text_of_the_sweep_and_run_figures_is_at_least_10_points():
    baseline = SweepPoint("9", "privacy = none", None, 0.9)
    figures = [sweep_figure([*sweep_points(GRID), baseline], "title", 1e-5, "a note " * 30),
               run_figure(run_series(RECORDS), "run", target_epsilon=3.0)]
    for figure in figures:
        small = [(t.get_text(), t.get_fontsize()) for t in _texts(figure) if t.get_fontsize() < 10]
        assert small == []


def test_the_run_figure_draws_epsilon_from_zero_and_accuracy_in_percent():
    from matplotlib.ticker import PercentFormatter

    loss, accuracy, epsilon = run_figure(run_series(RECORDS)).axes
    assert epsilon.get_title() == "epsilon spent" and epsilon.get_ylim()[0] == 0
    assert isinstance(accuracy.yaxis.get_major_formatter(), PercentFormatter)


def test_plot_sweep_of_no_usable_job_still_writes_a_png_saying_so(tmp_path):
    _assert_png(plot_sweep([], tmp_path / "empty.png"))


def test_drawing_without_matplotlib_is_a_config_error_naming_pip_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        plot_sweep([], tmp_path / "x.png")


def test_a_sweeps_accuracy_ticks_never_repeat_a_label():
    """Accuracies within two points get half-point ticks: 94.5%, 95.0%, not 94%, 95%, 95%."""
    points = [SweepPoint(str(i), f"sigma = {s}", e, a)
              for i, (s, e, a) in enumerate([(2, 0.5, 0.941), (1, 1.1, 0.952), (0.5, 3.0, 0.961)])]
    figure = sweep_figure(points)
    figure.canvas.draw()
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels


def test_the_sweep_note_puts_each_part_on_its_own_line_and_no_number_alone():
    note = ("releasing the best job costs epsilon 12.34 at delta 1e-05: the 3 jobs composed (prv); "
            "random stopping (truncated negative binomial, mean 4 trials, rdp): epsilon 8.123")
    lines = sweep_figure([SweepPoint("0", "sigma = 1", 2.7, 0.75)], note=note)._suptitle.get_text().split("\n")
    assert lines[0].startswith("releasing") and lines[-1].startswith("random stopping")
    assert not any(line.replace(".", "").replace(" ", "").isdigit() for line in lines)


def test_a_short_runs_step_axis_has_whole_steps_only():
    """One logged point at step 2: ticks 1.9, 1.925, ... read as fractional steps."""
    figure = run_figure(run_series([{"step": 2, "epoch": 1, "test_loss": 2.3, "test_accuracy": 0.12,
                                     "epsilon": 0.27}]))
    figure.canvas.draw()
    for ax in figure.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


PAPER_TEXT_WIDTH_IN = 7.5   # inches: a figure wider than this is shrunk in print, and its text too


def test_every_point_label_of_the_sweep_figure_lies_inside_its_axes():
    """The rightmost point's label ran past the frame (and a long one past the figure's edge)."""
    points = [SweepPoint(str(i), f"noise multiplier = {s}", e, a) for i, (s, e, a) in
              enumerate([(2, 1.2, 0.881), (1, 3.1, 0.9315), (0.5, 9.7, 0.9412)])]
    figure = sweep_figure(points, "title", 1e-5)
    figure.draw_without_rendering()
    frame = figure.axes[0].get_window_extent()
    labels = [t for t in figure.axes[0].texts if t.get_text().startswith("noise multiplier")]
    assert len(labels) == 3
    for label in labels:
        box = label.get_window_extent()
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0, label.get_text()


def test_the_run_figure_fits_a_papers_text_width_so_its_10_point_text_prints_near_10_points():
    """It was 13.2 inches wide: at a 7-inch text width its 10-point labels printed at 5 points."""
    width, _ = run_figure(run_series(RECORDS), "run", target_epsilon=3.0).get_size_inches()
    assert width <= PAPER_TEXT_WIDTH_IN


def test_no_legend_of_the_run_figure_covers_its_curves():
    """Narrow panels: each legend sits under its panel, outside the plotting area."""
    figure = run_figure(run_series(RECORDS), "run", target_epsilon=3.0)
    figure.draw_without_rendering()
    for ax in figure.axes:
        legend = ax.get_legend()
        if legend is not None:
            assert legend.get_window_extent().y1 <= ax.get_window_extent().y0, ax.get_title()


def test_no_point_label_of_the_sweep_figure_lies_on_its_line():
    """A peak's label below right of it sat on the falling segment after it (the docs' sweep:
    sigma = 2 above sigma = 1)."""
    import numpy as np

    points = [SweepPoint(str(i), f"sigma = {s}", e, a) for i, (s, e, a) in enumerate(
        [(4, 0.671, 0.8592), (2, 1.60, 0.8901), (1, 4.98, 0.8789), (0.7, 10.5, 0.8873)])]
    figure = sweep_figure(points, "title", 1e-5)
    figure.draw_without_rendering()
    ax = figure.axes[0]
    vertices = ax.transData.transform(ax.lines[0].get_xydata())
    path = np.concatenate([np.linspace(a, b, 200) for a, b in zip(vertices, vertices[1:])])
    for label in ax.texts:
        box = label.get_window_extent().expanded(0.98, 0.9)
        inside = [(x, y) for x, y in path if box.x0 < x < box.x1 and box.y0 < y < box.y1]
        assert inside == [], label.get_text()
