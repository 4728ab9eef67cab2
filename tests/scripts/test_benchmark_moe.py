"""Smoke test of scripts/benchmark_moe.py on a tiny Mixtral (no timing assertions)."""

import pytest

from script_loader import load_script

pytest.importorskip("transformers")
TINY = dict(hidden=16, inner=16, experts=4, layers=1, heads=2, vocab=50, seq=8, batch=2)


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmark_moe")


def test_a_ghost_step_of_the_moe_model_is_timed_measured_and_keeps_the_experts_on_the_ghost_path(bench) -> None:
    record = bench.worker("dptrain_ghost", bench.Shape(**TINY), steps=2)
    assert len(record["step_times_s"]) == 2 and record["median_step_s"] > 0
    assert record["peak_memory_mib"] >= 0 and record["moe_strategies"]["experts"] == ["ghost"]
    assert len(record["moe_strategies"]["routers"]) == 1  # 16 tokens x 4 experts: either path


def test_the_table_gives_each_method_its_multiple_of_plain(bench) -> None:
    records = [{"method": "plain", "median_step_s": 2.0, "peak_memory_mib": 100.0},
               {"method": "dptrain_ghost", "median_step_s": 3.0, "peak_memory_mib": 150.0}]
    assert "dptrain_ghost     3.000  ( 1.50)      150.0  ( 1.50)" in bench.table(records)
