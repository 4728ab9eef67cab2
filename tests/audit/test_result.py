"""From scores to guesses and a verdict; what audit.json holds."""

import json
import sys

import numpy as np
import pytest

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.audit.bound import epsilon_lower_bound
from dptrain.audit.fdp import gdp_mu_lower_bound
from dptrain.audit.result import AuditResult, GuessingRules, audit_scores, count_correct, write_audit
from dptrain.errors import ConfigError
from dptrain.formatting import format_epsilon


def test_each_fraction_gives_a_top_rule_and_a_top_and_bottom_rule():
    rules = GuessingRules(fractions=(0.1, 0.25), sides=("top", "top_and_bottom"))
    assert rules.counts(20) == [(2, 0), (1, 1), (5, 0), (3, 2)]


def test_rules_that_guess_no_canary_are_dropped():
    assert GuessingRules(fractions=(0.01, 0.5), sides=("top",)).counts(10) == [(5, 0)]
    with pytest.raises(ConfigError, match="guesses no canary"):
        GuessingRules(fractions=(0.01,)).counts(10)


@pytest.mark.parametrize("fractions", [(), (0.0,), (1.5,), (True,)])
def test_guess_fractions_outside_zero_one_are_refused(fractions):
    with pytest.raises(ConfigError, match="audit.guesses"):
        GuessingRules(fractions=fractions)


def test_unknown_guess_side_is_refused():
    with pytest.raises(ConfigError, match="audit.guess_sides"):
        GuessingRules(sides=("middle",))


def test_top_guesses_count_included_and_bottom_guesses_count_excluded():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0])
    included = np.array([True, False, True, False, False])
    assert count_correct(scores, included, 2, 0) == 1
    assert count_correct(scores, included, 1, 2) == 3


def test_ties_are_broken_by_canary_index_not_by_inclusion():
    scores = np.zeros(4)
    assert count_correct(scores, np.array([False, True, True, True]), 1, 0) == 0
    assert count_correct(scores, np.array([True, False, False, False]), 1, 0) == 1


def _canaries() -> tuple[np.ndarray, np.ndarray]:
    """Scores and inclusion of 400 canaries, about half included (their scores shifted by 3)."""
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    return included * 3.0 + rng.standard_normal(400), included


def _two_rule_audit(scores: np.ndarray, included: np.ndarray) -> AuditResult:
    """The audit of `scores` under two guessing rules (the top 10 % and 50 %)."""
    rules = GuessingRules(fractions=(0.1, 0.5), sides=("top",))
    return audit_scores(scores, included, kind="white_box", score="all_iterates",
                        claimed_epsilon=10.0, delta=1e-5, rules=rules)


def test_the_result_reports_the_best_rule_at_the_bonferroni_confidence():
    scores, included = _canaries()
    result = _two_rule_audit(scores, included)
    assert len(result.rules) == 2 and result.correction == "bonferroni"
    assert result.lower_bound == pytest.approx(epsilon_lower_bound(
        400, result.guesses, result.correct, 1e-5, 1 - 0.05 / 2))
    assert result.included == int(included.sum()) and result.canaries == 400


def test_a_lower_bound_above_the_claim_is_a_violation():
    included = np.arange(200) < 100
    result = audit_scores(included.astype(float), included, kind="white_box",
                          score="all_iterates", claimed_epsilon=0.5, delta=1e-5)
    assert result.violation
    assert result.verdict.startswith("VIOLATION: the run leaked more than it claims")
    assert "VIOLATION" in result.summary()


def test_an_infinite_claim_is_never_violated():
    included = np.arange(200) < 100
    result = audit_scores(included.astype(float), included, kind="white_box",
                          score="all_iterates", claimed_epsilon=float("inf"), delta=1e-5)
    assert not result.violation and result.verdict.startswith("consistent")


def test_non_finite_scores_are_refused():
    with pytest.raises(ConfigError, match="not finite"):
        audit_scores(np.array([1.0, np.nan]), np.array([True, False]), kind="white_box",
                     score="all_iterates", claimed_epsilon=1.0, delta=1e-5)


def test_audit_json_is_written_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    included = np.arange(100) < 50
    result = audit_scores(included.astype(float), included, kind="white_box",
                          score="all_iterates", claimed_epsilon=1.0, delta=1e-5)
    with pytest.warns(UserWarning, match="dptrain\\[audit\\]"):
        write_audit(result, included.astype(float), included, tmp_path)
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["figure"] is None and record["violation"] == result.violation
    assert not (tmp_path / "audit_scores.png").exists()


def test_the_result_reports_the_best_fdp_bound_of_the_rules_at_the_bonferroni_confidence():
    scores, included = _canaries()
    result = _two_rule_audit(scores, included)
    expected = [gdp_mu_lower_bound(400, rule.guesses, rule.correct, 1 - 0.05 / 2)
                for rule in result.rules]
    assert [rule.fdp_mu_lower_bound for rule in result.rules] == pytest.approx(expected)
    assert result.fdp_mu_lower_bound == max(expected) > 0
    assert result.fdp_lower_bound == gdp_epsilon(result.fdp_mu_lower_bound, 1e-5)
    assert result.fdp_correct == count_correct(scores, included, result.fdp_guesses, 0)


def test_audit_json_holds_both_the_epsilon_delta_bound_and_the_fdp_bound(tmp_path):
    rng = np.random.default_rng(1)
    included = rng.random(400) < 0.5
    scores = included * 3.0 + rng.standard_normal(400)
    result = audit_scores(scores, included, kind="white_box", score="all_iterates",
                          claimed_epsilon=10.0, delta=1e-5, out_dir=tmp_path)
    record = json.loads((tmp_path / "audit.json").read_text())
    assert record["lower_bound"] == pytest.approx(result.lower_bound) and result.lower_bound > 0
    assert record["fdp_lower_bound"] == pytest.approx(result.fdp_lower_bound)
    assert record["fdp_mu_lower_bound"] == pytest.approx(result.fdp_mu_lower_bound)
    assert result.fdp_mu_lower_bound > 0
    assert record["fdp_exceeds_claim"] is False
    assert all("fdp_lower_bound" in rule and "lower_bound" in rule for rule in record["rules"])


def test_the_verdict_and_the_summary_state_both_bounds():
    included = np.arange(200) < 100
    result = audit_scores(included.astype(float), included, kind="white_box",
                          score="all_iterates", claimed_epsilon=float("inf"), delta=1e-5)
    for text in (result.verdict, result.summary()):
        assert format_epsilon(result.lower_bound, rounding="down") in text
        assert "f-DP (Gaussian" in text and format_epsilon(result.fdp_lower_bound, rounding="down") in text


def test_an_fdp_bound_above_the_claim_is_flagged_beside_the_verdict():
    # 200 of 200 canaries separated: both bounds exceed a claim of 1.
    included = np.arange(200) < 100
    result = audit_scores(included.astype(float), included, kind="white_box",
                          score="all_iterates", claimed_epsilon=1.0, delta=1e-5)
    assert result.fdp_exceeds_claim and result.violation
    assert result.to_dict()["fdp_exceeds_claim"] is True
