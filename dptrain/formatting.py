"""How dptrain writes an epsilon for people: one rule, used by every message, table and figure.

An epsilon is a bound, so its text must not claim more privacy than the number does: a spent or
claimed epsilon (an upper bound) is rounded UP, an audit's empirical lower bound DOWN, each to
`EPSILON_DIGITS` significant digits, trailing zeros kept (2.99348 is "3.00" everywhere: the
console, the logs, the summary table, `dptrain report`, the sweep table and its caption, the
verifier, the audit). Stored values (ledgers, metrics, result.json) keep full precision; only
their text is rounded. Torch-free, and imports nothing from dptrain.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Literal

#: significant digits of an epsilon in text (a verifier's comparison of two values passes more)
EPSILON_DIGITS = 3

_ROUNDING = {"up": ROUND_CEILING, "down": ROUND_FLOOR}


def format_epsilon(value: float | int | str, digits: int = EPSILON_DIGITS,
                   rounding: Literal["up", "down"] = "up") -> str:
    """`value` to `digits` significant digits, rounded toward the safe side.

    rounding: "up" for an upper bound (an epsilon spent, claimed, or needed: a privacy claim
    never reads smaller than it is), "down" for a lower bound (an audit's empirical epsilon).
    The value rounded is the float's shortest decimal form (repr), so 0.1 stays "0.100". Fixed
    notation from 1e-4 to below 1e6, else scientific ("1.24e+7"); "inf" for infinity (a
    noiseless step), "nan" for NaN. A string is read as a number (JSON's "inf").
    """
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        return str(number)
    if number == 0:
        return "0"
    exact = Decimal(repr(number))
    mode = _ROUNDING[rounding]
    rounded = _to_digits(exact, exact.adjusted(), digits, mode)
    if rounded.adjusted() > exact.adjusted():  # 9.996 up is 10.00: one digit too many
        rounded = _to_digits(rounded, rounded.adjusted(), digits, mode)
    if -4 <= rounded.adjusted() < 6:
        return f"{rounded:f}"
    return f"{rounded:.{digits - 1}e}"


def _to_digits(value: Decimal, leading: int, digits: int, mode: str) -> Decimal:
    """`value` rounded (`mode`) to a multiple of 10 ** (leading - digits + 1): `digits`
    significant digits when `leading` is the exponent of its first digit."""
    return value.quantize(Decimal(1).scaleb(leading - digits + 1), rounding=mode)
