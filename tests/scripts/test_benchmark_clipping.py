"""Smoke test of scripts/benchmark_clipping.py on tiny settings (no timing assertions)."""


import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_clipping")


def test_time_methods_reports_median_and_fastest_step_of_every_method(bench) -> None:
    times = bench.time_methods("digits_mlp", ["plain", "hooks", "ghost"], batch=4, steps=3)
    assert set(times) == {"plain", "hooks", "ghost"}
    for timing in times.values():
        assert 0 < timing["fastest"] <= timing["median"]


def test_peak_memory_counts_what_a_step_allocates_after_the_high_water_mark_is_reset(bench) -> None:
    bench.reset_peak_rss()
    ballast = bytearray(64 * 2**20)  # an earlier peak that the step must not inherit
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    del ballast
    assert bench.peak_memory("digits_mlp", "ghost", batch=4) < 32


def test_layers_subcommand_prints_each_layer_choice(bench, capsys) -> None:
    bench.main(["layers", "--models", "digits_mlp", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert "ghost" in out or "instantiate" in out
