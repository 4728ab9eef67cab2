"""Noise calibration: the smallest noise multiplier whose epsilon meets a target."""

from __future__ import annotations

import math
import warnings
from typing import Callable

from dptrain.accounting.history import steps_per_epoch  # noqa: F401  (re-exported: its old home)
from dptrain.accounting.events import AccountingEvent, as_event
from dptrain.accounting.registry import get_accountant
from dptrain.checks import check_delta, check_epsilon, check_sample_rate, check_steps
from dptrain.errors import PrivacyError, UnreachableEpsilonError

SIGMA_MIN = 1e-3   # below this, calibration reports the target as too loose to need noise
SIGMA_MAX = 1e4    # above this, the target is declared unreachable


def steps_for(sample_rate: float, steps: int | None, epochs: float | None) -> int:
    """Number of steps from `steps`, or from `epochs`: ceil(epochs * steps_per_epoch(q)), the
    steps the trainer runs; exactly one given."""
    if (steps is None) == (epochs is None):
        raise PrivacyError(
            "pass exactly one of steps= (number of optimizer steps) or epochs= (passes over the "
            f"data, steps = ceil(epochs * ceil(1 / sample_rate))); got steps={steps!r}, "
            f"epochs={epochs!r}."
        )
    if steps is not None:
        n = check_steps(steps)
    else:
        try:
            e = float(epochs)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise PrivacyError(f"epochs={epochs!r} is not a number: pass e.g. epochs=10.") from None
        if not (e > 0 and math.isfinite(e)):
            raise PrivacyError(f"epochs={epochs!r} must be a positive number, e.g. 10.")
        n = math.ceil(e * steps_per_epoch(sample_rate) - 1e-9)
    if n < 1:
        raise PrivacyError(f"steps={n} is too small: calibration needs at least one step.")
    return n


def _epsilon_function(accountant: str, sample_rate: float, steps: int, delta: float,
                      sampling: str | AccountingEvent = "poisson") -> Callable[[float], float]:
    def epsilon(sigma: float) -> float:
        acc = get_accountant(accountant, sampling)
        acc.step(noise_multiplier=sigma, sample_rate=sample_rate, steps=steps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return acc.get_epsilon(delta)

    return epsilon


def calibrate_sigma(epsilon: Callable[[float], float], target: float, tolerance: float,
                    sigma_hi: float | None = None) -> float:
    """Smallest sigma (to within `tolerance` in epsilon) with epsilon(sigma) <= target.

    `epsilon` must be non-increasing in sigma. Returns a sigma whose epsilon was evaluated and is
    in [target - tolerance, target] (or <= target when the curve is flat there, or when sigma
    reaches SIGMA_MIN); math.inf when even SIGMA_MAX exceeds the target. `sigma_hi`, a sigma
    believed to meet the target, narrows the initial bracket.
    """
    hi = sigma_hi if sigma_hi is not None else 1.0
    eps_hi = epsilon(hi)
    while eps_hi > target:
        if hi >= SIGMA_MAX:
            return math.inf
        hi = min(hi * 2.0, SIGMA_MAX)
        eps_hi = epsilon(hi)
    factor = 0.9 if sigma_hi is not None else 0.5  # a good starting guess brackets narrowly
    while eps_hi < target - tolerance:
        if hi <= SIGMA_MIN:
            return hi
        lo, eps_lo = hi * factor, epsilon(hi * factor)
        if eps_lo > target:
            return _refine(epsilon, target, tolerance, (lo, eps_lo), (hi, eps_hi))
        hi, eps_hi = lo, eps_lo
    return hi


def _refine(epsilon: Callable[[float], float], target: float, tolerance: float,
            low: tuple[float, float], high: tuple[float, float]) -> float:
    """Shrink the bracket (lo, eps_lo > target), (hi, eps_hi <= target) by the Illinois variant of
    regula falsi on (log sigma, epsilon - target), bisecting when the interpolant is unusable.
    Only sigmas whose evaluated epsilon is <= target are ever returned."""
    x_lo, y_lo = math.log(low[0]), low[1] - target
    x_hi, y_hi = math.log(high[0]), high[1] - target
    side = 0
    for _ in range(100):
        x = (x_lo * y_hi - x_hi * y_lo) / (y_hi - y_lo) if math.isfinite(y_lo) else math.nan
        if not (x_lo < x < x_hi):
            x = 0.5 * (x_lo + x_hi)
        y = epsilon(math.exp(x)) - target
        if y <= 0:
            x_hi, y_hi = x, y
            if y >= -tolerance:
                break
            y_lo, side = (y_lo / 2 if side == -1 else y_lo), -1
        else:
            x_lo, y_lo = x, y
            y_hi, side = (y_hi / 2 if side == 1 else y_hi), 1
        if x_hi - x_lo <= 1e-10:
            break
    return math.exp(x_hi)


def get_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float,
                         steps: int | None = None, epochs: float | None = None,
                         accountant: str = "rdp", epsilon_tolerance: float = 0.01,
                         sampling: str | AccountingEvent = "poisson") -> float:
    """Smallest noise multiplier whose epsilon at target_delta is <= target_epsilon (steps
    charged as `sampling`: poisson | shuffle, or an AccountingEvent with cyclic Poisson sampling
    or correlated noise; dptrain.accounting.get_accountant).

    The result's epsilon is never above the target and (unless the target is so loose that
    sigma = 1e-3 meets it) within `epsilon_tolerance` below it. Raises PrivacyError naming
    target_epsilon when even sigma = 1e4 cannot reach the target.
    """
    target = check_epsilon(target_epsilon, "target_epsilon")
    if target == 0 or math.isinf(target):
        raise PrivacyError(
            f"target_epsilon={target_epsilon!r} is not reachable: use a finite target > 0, e.g. 3.0."
        )
    delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    if q == 0:
        raise PrivacyError("sample_rate=0 spends no privacy: any noise multiplier works; use q in (0, 1].")
    n = steps_for(q, steps, epochs)
    if not epsilon_tolerance > 0:
        raise PrivacyError(f"epsilon_tolerance={epsilon_tolerance!r} must be > 0, e.g. 0.01.")
    epsilon = _epsilon_function(accountant, q, n, delta, sampling)
    start = None
    event = as_event(sampling)
    if accountant == "prv" and event.traits.amplifies and (event.plain or event.amplified(n)):
        # the PRV epsilon never exceeds the RDP one, so the RDP sigma meets the target: start there
        start = calibrate_sigma(_epsilon_function("rdp", q, n, delta, event), target,
                                epsilon_tolerance)
    sigma = calibrate_sigma(epsilon, target, epsilon_tolerance,
                            start if start is not None and math.isfinite(start) else None)
    if math.isinf(sigma):
        best = epsilon(SIGMA_MAX)
        raise UnreachableEpsilonError(
            f"target_epsilon={target_epsilon!r} is unreachable with sample_rate={q}, steps={n}, "
            f"target_delta={delta}: even noise_multiplier={SIGMA_MAX:g} gives epsilon {best:.4g} "
            f"(achievable range: [{best:.4g}, inf)); raise target_epsilon or reduce steps/sample_rate.",
            target, best, q, n, delta)
    return sigma
