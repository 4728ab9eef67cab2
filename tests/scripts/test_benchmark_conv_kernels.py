"""Smoke test of scripts/benchmark_conv_kernels.py on a tiny setting (no timing assertions)."""

from script_loader import load_script


def _load():
    return load_script("benchmark_conv_kernels")


def test_both_kernels_are_timed_agree_and_the_rule_choice_is_shown(capsys) -> None:
    rows = _load().main(["--batch-sizes", "2", "--repeats", "1", "--layers", "2", "3", "5", "--layers", "4", "128", "2"])
    assert [(r["c_in"], r["rule"]) for r in rows] == [(2, "grouped"), (4, "unfold")]
    assert all(r["grouped_ms"] > 0 and r["unfold_ms"] > 0 and r["max_diff"] < 1e-4 for r in rows)
    assert "unfold/grouped" in capsys.readouterr().out
