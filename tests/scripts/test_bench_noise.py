"""Smoke test of scripts/bench_noise.py on tiny settings (no timing assertions)."""

import json

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_noise")


def test_each_strategy_gets_a_time_ratio_and_holds_its_stated_copies_of_the_parameters(
        bench, tmp_path, capsys) -> None:
    out = tmp_path / "noise.json"
    bench.main(["--models", "mnist_cnn", "--steps", "1", "--warmup", "3", "--horizon", "20",
                "--device", "cpu", "--json", str(out)])
    assert "x indep" in capsys.readouterr().out
    figures = json.loads(out.read_text())["results"]["mnist_cnn"]
    assert set(figures) == {"independent", "banded4", "blt3"}
    # after 4 steps banded holds its b - 1 = 3 outputs, BLT its d = 3 running sums
    copies = {key: f["buffer_bytes"] / f["param_bytes"] for key, f in figures.items()}
    assert copies == {"independent": 0.0, "banded4": 3.0, "blt3": 3.0}
    assert figures["independent"]["time_ratio"] == 1.0
    assert all(f["step_ms"] > 0 and f["noise_ms"] > 0 for f in figures.values())
