"""Argument and setting checks: each rule once, used by every caller.

A `Rule` is what a setting accepts, as a test and as the words that say it ("an integer >= 1").
The CLI's typed configs attach rules to their fields (`setting`), so a config key, its Python
argument and its error message all follow the same rule; `check_fields` applies them.
Each check returns the value (converted where said) or raises the `dptrain.errors` exception
naming the key or argument, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dptrain.errors import ConfigError, DPTrainError, PrivacyError


def is_real(value: Any) -> bool:
    """A real number (int, float, numpy scalar), not a bool (True would silently mean 1)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An integer (int or numpy integer), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Rule:
    """What a value may be: `test(value)` is True for accepted values; `accepts` says which."""

    accepts: str
    test: Callable[[Any], bool]
    error: type[DPTrainError] = ConfigError

    def check(self, value: Any, key: str) -> Any:
        """`value` unchanged when accepted, else `error` naming `key`, the value and the rule."""
        if not self.test(value):
            raise self.error(f"{key}={value!r} is not accepted: {key} takes {self.accepts}.")
        return value

    def or_none(self) -> Rule:
        """The same rule, also accepting None (null in a config)."""
        return Rule(f"{self.accepts}, or null", lambda v: v is None or self.test(v), self.error)


def one_of(*choices: str) -> Rule:
    """One of `choices` (strings)."""
    return Rule(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices)


POSITIVE_INT = Rule("an integer >= 1", lambda v: is_int(v) and v >= 1)
NON_NEGATIVE_INT = Rule("an integer >= 0", lambda v: is_int(v) and v >= 0)
EVERY_EPOCHS = Rule("an integer >= 0 (0: only at the end of training)",
                    lambda v: is_int(v) and v >= 0)
BOOLEAN = Rule("true or false", lambda v: isinstance(v, bool))
TEXT = Rule("a string", lambda v: isinstance(v, str))
NUMBER = Rule("a number", is_real)
NON_NEGATIVE_NUMBER = Rule("a finite number >= 0", lambda v: is_real(v) and math.isfinite(v) and v >= 0)
POSITIVE_NUMBER = Rule("a finite number > 0", lambda v: is_real(v) and math.isfinite(v) and v > 0)
UNIT_INTERVAL = Rule("a number in (0, 1]", lambda v: is_real(v) and 0 < v <= 1)
NUMBERS = Rule("a list of numbers",
               lambda v: isinstance(v, (list, tuple)) and all(is_real(x) for x in v))
POSITIVE_INTS = Rule("a list of integers >= 1",
                     lambda v: isinstance(v, (list, tuple)) and all(is_int(x) and x >= 1 for x in v))
COUNT_OR_FRACTION = Rule(
    "a count of examples (an integer >= 0) or a fraction of them (a number in [0, 1))",
    lambda v: (is_int(v) and v >= 0) or (is_real(v) and 0 <= v < 1))


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None,
            **kwargs: Any) -> Any:
    """A dataclass field carrying its `rule` (read by `check_fields` and the CLI's messages)."""
    metadata = {"rule": rule} if rule is not None else {}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata,
                                 **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def field_rules(schema: type) -> dict[str, Rule]:
    """{field name: rule} of a dataclass built with `setting`."""
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(schema) if "rule" in f.metadata}


def check_fields(values: Any, schema: type, prefix: str) -> None:
    """Apply `schema`'s field rules to `values` (a mapping or an instance), keys `prefix.NAME`.

    Keys absent from a mapping are skipped (their absence is reported where it matters).
    """
    for name, rule in field_rules(schema).items():
        if isinstance(values, Mapping):
            if name not in values:
                continue
            value = values[name]
        else:
            value = getattr(values, name)
        rule.check(value, f"{prefix}.{name}")


# ----------------------------------------------------------------------------- privacy parameters
def check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """sigma as a float: a finite number >= 0 (the Gaussian noise std in units of the clipping
    norm), else PrivacyError naming `name`."""
    if not (is_real(value) and math.isfinite(value) and value >= 0):
        raise PrivacyError(f"{name}={value!r} must be a finite noise multiplier >= 0 (the "
                           "Gaussian noise std in units of the clipping norm); pass e.g. 1.0.")
    return float(value)


def check_sample_rate(value: Any, name: str = "sample_rate", *, allow_zero: bool = False) -> float:
    """q as a float: the probability that an example is in a batch (expected batch size / N).

    Sampling with q needs q in (0, 1]: q * N is the divisor of the noisy average and 1 / q the
    length of an epoch. A *recorded* step may have q = 0 (`allow_zero`: an accountant's history,
    a ledger): it sampled nobody and spends nothing.
    """
    low = 0 if allow_zero else math.nextafter(0.0, 1.0)
    if not (is_real(value) and low <= value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise PrivacyError(f"{name}={value!r} must be a sample rate in {interval}: the "
                           "probability that an example is in a batch (the expected batch size "
                           "divided by the dataset size).")
    return float(value)


def check_steps(value: Any, name: str = "steps") -> int:
    """A number of steps as an int >= 0, else PrivacyError naming `name`."""
    if not (is_real(value) and math.isfinite(value) and value == int(value)):
        raise PrivacyError(f"{name}={value!r} is not an integer: pass the number of steps, e.g. 1.")
    if value < 0:
        raise PrivacyError(f"{name}={value!r} is negative: the number of steps must be >= 0.")
    return int(value)


def check_delta(value: Any, name: str = "delta") -> float:
    """delta as a float in (0, 1) (a probability of failure), else PrivacyError naming `name`."""
    if not (is_real(value) and 0 < value < 1):
        raise PrivacyError(f"{name}={value!r} must be in (0, 1): delta is a probability of "
                           "failure; use a value well below 1/dataset_size, e.g. 1e-5.")
    return float(value)


def default_delta(num_examples: int) -> float:
    """The delta used when none is given (privacy.target_delta null, dptrain-privacy without
    --delta): 1/(10 N) rounded down to a power of ten (N = 1,442 -> 1e-5, N = 60,000 -> 1e-6)."""
    exponent = len(str(10 * max(1, int(num_examples)) - 1))  # smallest k with 10^k >= 10 N
    return float(10.0**-exponent)


def check_epsilon(value: Any, name: str = "epsilon", *, target: bool = False) -> float:
    """epsilon as a float >= 0 (natural-log units); a `target` epsilon must be finite and > 0."""
    ok = is_real(value) and not math.isnan(value) and value >= 0
    if target:
        ok = ok and 0 < value < math.inf
    if not ok:
        kind = "a finite epsilon > 0" if target else "an epsilon >= 0"
        raise PrivacyError(f"{name}={value!r} must be {kind} (natural-log units), e.g. 3.0.")
    return float(value)


def check_max_grad_norm(value: Any, name: str = "max_grad_norm", *,
                        per_layer: bool = False) -> float | list[float]:
    """C, the clipping norm: a finite number > 0; with per-layer clipping also a list of them
    (one bound per parameter). PrivacyError naming `name` otherwise."""
    if per_layer and isinstance(value, (list, tuple)):
        return [check_max_grad_norm(v, f"{name}[{i}]") for i, v in enumerate(value)]  # type: ignore[misc]
    if not (is_real(value) and math.isfinite(value) and value > 0):
        also = " (or, with per-layer clipping, a list of them)" if per_layer else ""
        raise PrivacyError(f"{name}={value!r} must be a finite clipping norm > 0{also}: the bound "
                           "C on each sample's gradient L2 norm; pass e.g. 1.0.")
    return float(value)
