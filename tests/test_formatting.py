"""One rule for an epsilon in text (dptrain.formatting), and every place that shows one using it.

The issue: a run calibrated to epsilon 3 spent 2.99348, shown as "3" in some places and "2.993"
in others; and "raise privacy.target_epsilon to at least 2.99" asked for less than the 2.99348
the calibration needed (a bound rounded down)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from dptrain.formatting import EPSILON_DIGITS, format_epsilon

SPENT = 2.99348   # shown "3.00" everywhere


def _values() -> list[float]:
    rng = random.Random(0)
    return [10 ** rng.uniform(-6, 8) for _ in range(2000)] + [
        0.1, 1.0, 3.0, 2.99348, 9.995, 9.9999, 99.95, 999.5, 0.0001, 123456.7]


@pytest.mark.parametrize("value", _values()[:50] + _values()[-10:])
def test_a_spent_epsilon_is_never_shown_below_its_value_and_by_at_most_one_last_digit(value):
    text = format_epsilon(value)
    shown = float(text)
    assert shown >= value
    step = 10 ** (math.floor(math.log10(shown)) - EPSILON_DIGITS + 1)
    assert shown - value <= step * (1 + 1e-9)
    assert abs(shown / step - round(shown / step)) < 1e-6   # no digit below the third


def test_every_shown_epsilon_of_two_thousand_values_is_an_upper_bound_and_lower_bounds_lower():
    for value in _values():
        assert float(format_epsilon(value)) >= value
        assert float(format_epsilon(value, rounding="down")) <= value


def test_the_digits_and_notation_of_typical_values():
    assert [format_epsilon(v) for v in (SPENT, 3.0, 0.1, 9.996, 12345.6, 1e-7, 0.0)] == [
        "3.00", "3.00", "0.100", "10.0", "12400", "1.00e-7", "0"]
    assert format_epsilon(SPENT, rounding="down") == "2.99"
    assert format_epsilon(float("inf")) == format_epsilon("inf") == "inf"
    assert format_epsilon(SPENT, 6) == "2.99348"


# ----------------------------------------------------------------------------- every place
def test_the_closing_line_of_the_command_shows_the_rounded_up_epsilon():
    from dptrain.cli.main import _format_epsilon

    assert _format_epsilon(SimpleNamespace(epsilon=SPENT, delta=1e-5)) == \
        "epsilon = 3.00 at delta = 1e-05"


def test_the_summary_tables_privacy_rows_show_the_rounded_up_epsilon():
    from dptrain.train.display import privacy_rows

    ledger = SimpleNamespace(epsilon=SPENT, data={
        "accountant": "prv", "delta": 1e-5, "target": {"epsilon": 3.0},
        "mechanism": {"sampling": "poisson", "sample_rate": 0.01, "max_grad_norm": 1.0,
                      "clipping": "flat", "noise_multiplier": 1.1},
        "epsilon_by_accountant": {"prv": {"epsilon": SPENT, "approximate": True},
                                  "rdp": {"epsilon": 3.14159, "approximate": False}}})
    rows = dict(privacy_rows(ledger))
    assert rows["epsilon (prv)"].startswith("3.00 at delta=1e-05")
    assert rows["  epsilon under rdp"].startswith("3.15 (")


def test_dptrain_report_says_the_rounded_up_epsilon():
    from dptrain.report import run_summary

    assert "epsilon: 3.00 at delta = 1e-05" in run_summary({}, {"epsilon": SPENT, "delta": 1e-5})


def test_the_sweep_table_and_its_cost_caption_show_the_rounded_up_epsilon():
    from dptrain.cli.sweep import _cell
    from dptrain.cli.sweep_ledger import describe_cost

    assert _cell(SPENT, "epsilon") == "3.00"
    cost = {"delta": 1e-5, "epsilon": SPENT,
            "cost": {"all_composed": {"epsilon": SPENT, "accountant": "rdp"}}}
    assert "costs epsilon 3.00 at delta 1e-05" in describe_cost(cost, 3)


def test_the_ledger_verifier_shows_the_rounded_up_epsilon():
    from dptrain.cli.ledger_cmd import _num

    assert _num(SPENT) == "3.00"


def test_the_audit_rounds_its_claim_up_and_its_lower_bounds_down():
    from dptrain.audit.result import AuditResult

    result = AuditResult(kind="white_box", score="all_iterates", claimed_epsilon=SPENT,
                         delta=1e-5, lower_bound=1.23456, confidence=0.95, canaries=100,
                         included=50, guesses=10, correct=9, guesses_included=10,
                         guesses_excluded=0, fdp_lower_bound=1.98765)
    assert "lower bound 1.23 <= claimed epsilon 3.00" in result.verdict
    assert "f-DP (Gaussian) lower bound 1.98" in result.verdict
    assert "claimed epsilon 3.00 (upper bound), empirical lower bound 1.23" in result.summary()


def test_an_unreachable_target_asks_for_at_least_the_epsilon_it_needs_rounded_up():
    """It said "at least 2.99" for 2.99348: a target of 2.99 is still unreachable."""
    from dptrain.cli.build import _unreachable_in_keys
    from dptrain.errors import UnreachableEpsilonError

    error = UnreachableEpsilonError("no sigma", target_epsilon=1.0, best=SPENT,
                                    sample_rate=0.5, steps=100, delta=1e-5)
    message = str(_unreachable_in_keys(error, SimpleNamespace(epochs=10, batch_size=64), 128))
    assert "spends epsilon 3.00 at delta" in message
    assert "to at least 3.00," in message
