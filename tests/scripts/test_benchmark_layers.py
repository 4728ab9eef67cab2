"""Smoke test of scripts/benchmark_layers.py on tiny settings (no timing assertions)."""

import json
import math

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_layers")


def test_table_has_plain_and_wrapped_time_and_memory_with_their_ratios(bench, tmp_path, capsys) -> None:
    out_json = tmp_path / "rows.json"
    args = ["--layers", "Linear", "EmbeddingBag", "--batch-size", "2", "--repeats", "1", "--device", "cpu"]
    bench.main([*args, "--json", str(out_json)])
    table = capsys.readouterr().out
    for column in ("plain ms", "wrapped ms", "time x", "plain MB", "wrapped MB", "memory x"):
        assert column in table
    rows = json.loads(out_json.read_text())
    assert [r["layer"] for r in rows] == ["Linear", "EmbeddingBag"]
    assert all(r["plain_ms"] > 0 and r["wrapped_ms"] > 0 for r in rows)


def test_a_cell_that_fails_reports_nan_instead_of_stopping_the_run(bench, capfd) -> None:
    def broken() -> None:
        raise RuntimeError("this layer cannot run")

    case = bench.Case("Broken", broken, broken, lambda b: (), "[B]")
    args = bench.parse_args(["--device", "cpu", "--repeats", "1"])
    figures = bench.measure_in_subprocess(case, "wrapped", args)
    assert math.isnan(figures["ms"]) and math.isnan(figures["mb"])
    assert "Broken / wrapped: RuntimeError: this layer cannot run" in capfd.readouterr().err


def test_unknown_layer_name_is_refused_listing_the_known_ones(bench, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--layers", "Linaer"])
    error = capsys.readouterr().err
    assert "unknown layer(s) ['Linaer']" in error and "'Linear'" in error
