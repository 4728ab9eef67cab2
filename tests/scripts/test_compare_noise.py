"""Smoke test of scripts/compare_noise.py on one short epoch (no accuracy assertions)."""

import json

import pytest
from script_loader import load_script


@pytest.fixture(scope="module")
def compare():
    return load_script("compare_noise")


def test_every_mechanism_spends_the_same_epsilon_over_the_same_steps(compare, tmp_path,
                                                                     capsys) -> None:
    out, figure = tmp_path / "compare.json", tmp_path / "compare.png"
    compare.main(["--epsilons", "8", "--seeds", "1", "--bands", "2", "--epochs", "1",
                  "--json", str(out), "--figure", str(figure)])
    assert "| 8 |" in capsys.readouterr().out and figure.stat().st_size > 0
    results = json.loads(out.read_text())
    assert results["setup"]["steps"] == 23          # ceil(1442 / 64) steps of one epoch
    runs = {key: value for key, value in results.items() if "@" in key}
    assert set(runs) == {"dpsgd@8", "banded-2@8", "blt@8"}
    assert [runs[k]["groups"] for k in ("dpsgd@8", "banded-2@8", "blt@8")] == [1, 2, 22]
    for run in runs.values():  # each charged by its own accounting, calibrated to the target
        assert 8 * 0.98 <= run["epsilon_spent"][0] <= 8
    assert runs["dpsgd@8"]["sigma"] < runs["banded-2@8"]["sigma"] < runs["blt@8"]["sigma"]


def test_the_lines_at_one_epsilon_are_drawn_side_by_side_centred_on_it(compare) -> None:
    """Five mechanisms' error bars at one epsilon were drawn on top of one another."""
    factors = [compare.dodge(i, 5) for i in range(5)]
    assert factors == sorted(factors) and len(set(factors)) == 5
    assert factors[2] == 1.0 and factors[0] * factors[4] == pytest.approx(1.0)
    assert max(factors) < 2 ** 0.25   # well inside the octave between two epsilons
