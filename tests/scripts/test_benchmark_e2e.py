"""Smoke test of scripts/benchmark_e2e.py on a tiny configuration (no timing assertions)."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BATCH_SIZES = [4, 8]

sys.path.insert(0, str(SCRIPTS))
import _bench_data  # noqa: E402
import _bench_report  # noqa: E402
from script_loader import load_script


def load_benchmark():
    """Import the script as a module (it puts scripts/ on sys.path for its helpers)."""
    return load_script("benchmark_e2e")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


@pytest.fixture(scope="module")
def smoke_run(bench, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    bench.main(["--models", "mnist_cnn", "--batch-sizes", *map(str, BATCH_SIZES), "--epochs", "2",
                "--steps-per-epoch", "2", "--threads", "1", "--out", str(out)])
    return json.loads((out / "e2e.json").read_text()), out


def test_json_has_a_record_for_every_model_batch_size_and_method(bench, smoke_run) -> None:
    document, _ = smoke_run
    keys = {(r["model"], r["batch_size"], r["method"]) for r in document["results"]}
    assert keys == {("mnist_cnn", b, m) for b in BATCH_SIZES for m in bench.METHODS}


def test_every_available_method_runs_and_only_unavailable_ones_are_skipped(bench, smoke_run) -> None:
    document, _ = smoke_run
    for record in document["results"]:
        expected = "skipped" if bench.unavailable_reason(record["method"]) else "ok"
        assert record["status"] == expected, record


def test_successful_records_have_times_throughput_and_memory(smoke_run) -> None:
    document, _ = smoke_run
    for record in (r for r in document["results"] if r["status"] == "ok"):
        assert len(record["epoch_times_s"]) == 2
        assert record["median_epoch_s"] > 0 and record["samples_per_s"] > 0
        assert record["peak_memory_mb"] is not None
        assert record["full_epoch_estimate_s"] > record["median_epoch_s"]  # 60,000 samples


def test_json_records_the_environment(smoke_run) -> None:
    environment = smoke_run[0]["environment"]
    assert environment["device"] == "cpu" and environment["threads"] == 1
    assert environment["torch"]


def test_figures_and_markdown_table_are_written(smoke_run) -> None:
    _, out = smoke_run  # matplotlib is a test dependency (pyproject [test]): no skip
    assert (out / "e2e_runtime.png").stat().st_size > 0
    assert (out / "e2e_cumulative.png").stat().st_size > 0
    assert "mnist_cnn" in (out / "e2e.md").read_text()


def run_plain(bench, out: Path, *extra: str) -> list[dict]:
    bench.main(["--models", "mnist_cnn", "--batch-sizes", *map(str, BATCH_SIZES), "--methods",
                "plain", "--epochs", "1", "--steps-per-epoch", "1", "--threads", "1",
                "--out", str(out), *extra])
    return json.loads((out / "e2e.json").read_text())["results"]


def test_memory_limit_marks_configurations_oom_instead_of_crashing(bench, tmp_path) -> None:
    records = run_plain(bench, tmp_path, "--memory-limit-mb", "1")
    assert [r["status"] for r in records] == ["oom", "oom"]
    assert "smaller batch size" in records[1]["error"]


def test_time_limit_marks_configurations_timeout(bench, tmp_path) -> None:
    # 2,000 steps take seconds; the limit is a fraction of a second.
    records = run_plain(bench, tmp_path, "--steps-per-epoch", "2000", "--timeout-s", "0.3")
    assert [r["status"] for r in records] == ["timeout", "timeout"]


def record(method: str, median: float | None, status: str = "ok") -> dict:
    work = _bench_data.workload("mnist_cnn", 600, steps_per_epoch=10)  # a real epoch: 100 steps
    times = [] if median is None else [median * 2, median, median]
    return asdict(_bench_report.make_record(work, method, 3, status, times, peak_memory_mb=1.0))


def test_record_extrapolates_the_median_to_a_full_epoch_and_counts_throughput() -> None:
    r = record("plain", 2.0)
    assert r["median_epoch_s"] == 2.0 and r["first_epoch_s"] == 4.0
    assert r["full_epoch_estimate_s"] == pytest.approx(20.0)  # 100 real steps / 10 timed
    assert r["samples_per_s"] == pytest.approx(600 * 10 / 2.0)


def test_ratio_divides_median_times_at_the_same_model_and_batch_size() -> None:
    records = [record("plain", 2.0), record("opacus_hooks", 8.0), record("dptrain_hooks", 4.0)]
    assert _bench_report.ratio(records, records[2], "plain") == pytest.approx(2.0)
    assert _bench_report.ratio(records, records[2], "opacus_hooks") == pytest.approx(0.5)


def test_ratio_is_absent_when_the_reference_did_not_finish() -> None:
    records = [record("plain", None, status="oom"), record("dptrain_hooks", 4.0)]
    assert _bench_report.ratio(records, records[1], "plain") is None


def test_summary_names_the_fastest_private_method() -> None:
    records = [record("plain", 1.0), record("opacus_hooks", 8.0), record("dptrain_ghost", 3.0)]
    assert _bench_report.summary_rows(records)[0][-1] == "dptrain_ghost"


def test_the_summary_gives_ghost_mode_peak_memory_as_a_multiple_of_plain() -> None:
    plain, ghost = record("plain", 1.0), record("dptrain_ghost", 3.0)
    plain["peak_memory_mb"], ghost["peak_memory_mb"] = 100.0, 110.0
    row = _bench_report.summary_rows([plain, ghost])[0]
    assert row[_bench_report.SUMMARY_HEADERS.index("ghost mem / plain")] == "1.10"


def test_hf_models_report_their_layer_rules_and_ghost_choices() -> None:
    pytest.importorskip("peft")
    import _bench_hf

    report = _bench_hf.layer_choices("bert_base_lora", layers=1, batch_size=1)
    assert report["fallbacks"] == {"hooks": [], "ghost": []}
    # rank-8 adapters over 128 positions: forming their per-sample gradients is cheaper; the
    # classifier head (one position) takes the ghost path
    assert report["choices"] == {"Linear": {"instantiate": 4, "ghost": 1}}
    assert "Linear" in report["rules"]


def test_without_matplotlib_the_run_names_each_figure_it_skipped_and_why(
        bench, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "matplotlib_available", lambda: False)
    run_plain(bench, tmp_path)
    document = json.loads((tmp_path / "e2e.json").read_text())
    assert document["skipped_figures"] == {"e2e_runtime.png": "matplotlib is not installed (pip "
                                           "install matplotlib)",
                                           "e2e_cumulative.png": "matplotlib is not installed "
                                           "(pip install matplotlib)"}
    assert not list(tmp_path.glob("*.png")) and document["written"] == ["e2e.json", "e2e.md"]
    out = " ".join(capsys.readouterr().out.split())
    assert "e2e_runtime.png skipped: matplotlib is not installed" in out
    assert "(e2e.json, e2e.md); skipped: e2e_runtime.png, e2e_cumulative.png" in out


def test_a_cumulative_figure_with_nothing_finished_at_its_batch_size_is_skipped(bench) -> None:
    import argparse

    finished = record("plain", 1.0)     # batch size 600
    args = argparse.Namespace(cumulative_batch_size=None, batch_sizes=[256, 600])
    assert bench.skipped_figures(args, [finished]) == {
        "e2e_cumulative.png": "no configuration finished at batch size 256 "
                              "(--cumulative-batch-size)"}
    assert set(bench.skipped_figures(args, [record("plain", None, status="oom")])) == {
        "e2e_runtime.png", "e2e_cumulative.png"}


def test_bf16_precisions_put_the_weights_or_the_compute_in_bfloat16() -> None:
    import torch
    from torch.nn import functional as F

    import _bench_methods

    x = torch.randn(2, 4)
    pool = [(x, torch.tensor([0, 1]))]
    weights, weights_pool = _bench_methods.apply_precision("bf16_weights", torch.nn.Linear(4, 3), pool)
    assert weights.weight.dtype == torch.bfloat16 and weights_pool[0][0].dtype == torch.bfloat16
    linear = torch.nn.Linear(4, 3)
    autocast, same_pool = _bench_methods.apply_precision("bf16_autocast", linear, pool)
    out = autocast(x)
    assert linear.weight.dtype == torch.float32 and same_pool is pool and out.dtype == torch.float32
    expected = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
    assert torch.equal(out.detach(), expected.detach())
    with _bench_methods.building_at("bf16_weights"):  # created in bf16, no float32 copy first
        built = torch.nn.Linear(4, 3)
    assert built.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32


def test_the_precision_option_trains_every_dp_method_at_that_precision(bench, tmp_path) -> None:
    out = tmp_path / "bf16"
    bench.main(["--models", "mnist_cnn", "--batch-sizes", "4", "--methods", "plain", "dptrain_hooks",
                "dptrain_ghost", "--epochs", "1", "--steps-per-epoch", "1", "--threads", "1",
                "--precision", "bf16_weights", "--out", str(out)])
    document = json.loads((out / "e2e.json").read_text())
    assert document["settings"]["precision"] == "bf16_weights"
    assert {r["method"]: r["status"] for r in document["results"]} == \
        {"plain": "ok", "dptrain_hooks": "ok", "dptrain_ghost": "ok"}


def _figure_records(models: list[str], shortened: bool) -> list[dict]:
    """Finished records of 2 methods at batch sizes 16 to 1024 for each of `models`."""
    return [dict(model=model, method=method, batch_size=b, status="ok",
                 full_epoch_estimate_s=(100 + 2000 / b) * (1 + 0.4 * m),
                 steps_per_epoch=10 if shortened else 100, dataset_steps_per_epoch=100,
                 epoch_times_s=[10.0 * (1 + m)] * 3)
            for model in models for m, method in enumerate(["plain", "dp"])
            for b in (16, 32, 64, 128, 256, 512, 1024)]


@pytest.mark.parametrize("which", ["runtime", "cumulative"])
def test_the_benchmark_figures_fit_a_papers_text_width_with_plain_readable_ticks(
        tmp_path, monkeypatch, which: str) -> None:
    """Four models made a 17-inch row whose 7-point legend printed at 3 points, with batch
    sizes "2^4" and times "2 x 10^2"; now two panels a row, at most 7 inches wide, text >= 9
    points, plain numbers never repeated, one legend outside the panels."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import _bench_plots

    models = ["mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm"]
    records = _figure_records(models, shortened=True)
    drawn = []
    monkeypatch.setattr(_bench_plots, "_save", lambda plt_, fig, path: drawn.append(fig) or path)
    if which == "runtime":
        _bench_plots.runtime_figure(records, models, ["plain", "dp"], tmp_path / "f.png")
    else:
        _bench_plots.cumulative_figure(records, models, ["plain", "dp"], 256, tmp_path / "f.png")
    (fig,) = drawn
    fig.canvas.draw()
    assert fig.get_size_inches()[0] <= 7.0 and "extrapolated" in fig.get_suptitle()
    texts = [t for t in fig.findobj(plt.Text) if t.get_text().strip()]
    assert min(t.get_fontsize() for t in texts) >= 9
    for ax in fig.axes:
        for ticks in (ax.get_xticklabels(), ax.get_yticklabels()):
            labels = [t.get_text() for t in ticks if t.get_text()]
            assert labels and len(set(labels)) == len(labels), labels
            assert all(label.replace(".", "").isdigit() for label in labels), labels  # no 10^2
        assert ax.get_legend() is None   # the figure's one legend, below the panels
    assert len(fig.legends) == 1
    if which == "runtime":
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
            "16", "32", "64", "128", "256", "512", "1024"]
    plt.close(fig)


def test_the_overhead_table_gives_ms_per_step_and_the_excess_over_plain() -> None:
    records = [record("plain", 0.02), record("dptrain_hooks", 0.05), record("opacus_hooks", None, "oom")]
    row = _bench_report.overhead_rows(records)[0]  # 10 steps an epoch: 2 ms, 5 ms a step
    assert row[:3] == ["mnist_cnn", "600", "2.00"]
    assert row[_bench_report.OVERHEAD_HEADERS.index("dptrain_hooks ms/step (+ over plain)")] == "5.00 (+3.00)"
    assert row[_bench_report.OVERHEAD_HEADERS.index("opacus_hooks ms/step (+ over plain)")] == "-"
    assert "5.00 (+3.00)" in _bench_report.overhead_markdown(records)


def test_rounds_run_every_configuration_again_and_pool_their_epochs_on_the_cpu_clock(bench, tmp_path) -> None:
    bench.main(["--models", "one_layer", "--batch-sizes", "8", "--methods", "plain", "dptrain_hooks",
                "--epochs", "2", "--steps-per-epoch", "3", "--threads", "1", "--rounds", "2",
                "--clock", "cpu", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "e2e.json").read_text())
    assert document["settings"]["clock"] == "cpu"
    results = document["results"]
    assert [(r["model"], r["method"], r["status"]) for r in results] == [
        ("one_layer", "plain", "ok"), ("one_layer", "dptrain_hooks", "ok")]
    for r in results:  # 2 rounds of 2 epochs, the median over all 4
        assert r["epochs"] == 4 and len(r["epoch_times_s"]) == 4
        assert r["median_epoch_s"] == pytest.approx(sorted(r["epoch_times_s"])[1:3][0] / 2
                                                    + sorted(r["epoch_times_s"])[1:3][1] / 2)
    assert "ms/step" in (tmp_path / "e2e.md").read_text()


def test_the_cpu_clock_is_refused_for_a_gpu_and_times_the_process_cpu_seconds(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--clock", "cpu", "--device", "cuda"])
    import time

    import _bench_worker
    assert _bench_worker.CLOCKS == {"wall": time.perf_counter, "cpu": time.process_time}
