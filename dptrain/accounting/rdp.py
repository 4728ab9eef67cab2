"""Renyi DP accounting of the Poisson-subsampled Gaussian mechanism.

RDP of one step at order alpha follows Mironov, Talwar, Zhang (2019), "Renyi Differential Privacy
of the Sampled Gaussian Mechanism": an exact binomial expansion for integer orders and the
two-series erfc expansion for fractional orders, both summed in log space. Composition over a
history adds ``steps * RDP(alpha)`` over its runs. The conversion to (epsilon, delta) is the tight
one of Balle et al. (2020) / Canonne, Kamath, Steinke (2020) by default; the classic (Mironov 2017)
one, used by Abadi et al. (2016) and the TF Privacy tutorials, is available as ``"classic"``.
All epsilons are in nats (natural logarithm).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
from scipy import special

from dptrain.accounting.base import Accountant
from dptrain.accounting.history import History, coarsen_history
from dptrain.checks import check_delta, check_epsilon
from dptrain.errors import PrivacyError

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [round(1 + x / 100, 2) for x in range(1, 10)]
    + [round(1 + x / 10, 1) for x in range(1, 100)]
    + [float(a) for a in range(11, 64)]
    + [64.0, 80.0, 96.0, 128.0, 160.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0]
)
CONVERSIONS = ("tight", "classic")
# The two orders of a pair of neighbouring datasets under add/remove, whose Renyi divergences may
# differ: D(with || without), the "remove" direction, and D(without || with), "add". Runs charged
# under different analyses compose by adding their curves direction by direction.
REMOVE, ADD = "remove", "add"
DIRECTIONS = (REMOVE, ADD)
MAX_DISTINCT_PAIRS = 128  # more distinct (sigma, q) pairs are coarsened (see coarsen_history)

_TERM_CUTOFF = 34.0  # stop a series once n * (its last terms) are e^-34 below its largest term
_MAX_TERMS = 1 << 12


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log E[(P/Q)^alpha] for integer alpha: log of sum_k C(a,k) q^k (1-q)^(a-k) e^{(k^2-k)/2s^2}."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    terms = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q) + (k * k - k) / (2 * sigma**2)
    return float(special.logsumexp(terms))


def _log_a_fractional_terms(q: float, sigma: float, alphas: np.ndarray,
                            n: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-magnitudes and signs [len(alphas), 2n] of the first n terms of both series of
    Mironov et al. (2019) for fractional orders alphas [A]."""
    i = np.arange(n, dtype=np.float64)[None, :]
    a = alphas[:, None]
    j = a - i
    log_coef = special.gammaln(a + 1) - special.gammaln(i + 1) - special.gammaln(j + 1)
    sign = np.sign(special.gammasgn(j + 1))
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1q = math.log(q), math.log1p(-q)
    log_s0 = i * log_q + j * log_1q + (i * i - i) / (2 * sigma**2) + special.log_ndtr((z0 - i) / sigma)
    log_s1 = j * log_q + i * log_1q + (j * j - j) / (2 * sigma**2) + special.log_ndtr((j - z0) / sigma)
    logs = np.concatenate([log_coef + log_s0, log_coef + log_s1], axis=1)
    return logs, np.concatenate([sign, sign], axis=1)


def _log_a_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log E[(P/Q)^alpha] for fractional orders alphas [A] > 1.

    Each series is summed until its tail estimate (n times the last terms; the terms decay at
    least like i^-(alpha+1)) is e^-34 below the largest term, or n = 2^12 terms; the tail
    estimate is then ADDED, so a truncated sum errs upwards (a conservative RDP).
    """
    out = np.empty(alphas.size)
    todo = np.arange(alphas.size)
    n = 128
    while todo.size:
        logs, signs = _log_a_fractional_terms(q, sigma, alphas[todo], n)
        tail = np.concatenate([logs[:, n - 4 : n], logs[:, 2 * n - 4 :]], axis=1)
        log_tail = tail.max(axis=1) + math.log(2 * n)
        done = (log_tail < logs.max(axis=1) - _TERM_CUTOFF) | (n >= _MAX_TERMS)
        value, sign = special.logsumexp(logs[done], b=signs[done], axis=1, return_sign=True)
        value = np.where(sign > 0, value, -math.inf)
        out[todo[done]] = np.logaddexp(value, log_tail[done])
        todo = todo[~done]
        n *= 2
    return out


@lru_cache(maxsize=4096)
def _rdp_cached(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    if q == 1.0:
        return np.asarray(orders, dtype=np.float64) / (2 * sigma**2)
    alphas = np.asarray(orders, dtype=np.float64)
    integer = np.array([float(a).is_integer() for a in orders], dtype=bool)
    log_a = np.empty(alphas.size)
    log_a[integer] = [_log_a_integer(q, sigma, int(a)) for a in alphas[integer]]
    if (~integer).any():
        log_a[~integer] = _log_a_fractional(q, sigma, alphas[~integer])
    out = np.maximum(log_a, 0.0) / (alphas - 1)
    out.setflags(write=False)
    return out


def check_orders(orders: Sequence[float]) -> tuple[float, ...]:
    """Orders as a tuple of floats > 1; raise PrivacyError otherwise."""
    out = tuple(float(a) for a in orders)
    if not out or any(not (a > 1) or not math.isfinite(a) for a in out):
        raise PrivacyError(f"orders={orders!r} is invalid: RDP orders must be finite numbers > 1.")
    return out


def rdp_sampled_gaussian(sample_rate: float, noise_multiplier: float,
                         orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step, shape [len(orders)], in nats.

    0 when q == 0; +inf when sigma == 0 and q > 0.
    """
    orders_t = check_orders(orders)
    if sample_rate == 0.0:
        return np.zeros(len(orders_t))
    if noise_multiplier == 0.0:
        return np.full(len(orders_t), math.inf)
    return _rdp_cached(float(sample_rate), float(noise_multiplier), orders_t).copy()


def rdp_of_history(history: History, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """Composed RDP of a history, sum over runs of steps * RDP(alpha); shape [len(orders)]."""
    total = np.zeros(len(orders))
    for sigma, q, steps in history:
        total += steps * rdp_sampled_gaussian(q, sigma, orders)
    return total


def history_rdp(history: History, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """The RDP accountant's curve of a Poisson-sampled history, shape [len(orders)], nats:
    `rdp_of_history` after coarsening more than MAX_DISTINCT_PAIRS distinct (sigma, q) pairs.
    It bounds both directions of an add/remove pair (Mironov, Talwar, Zhang 2019: removing the
    example is the worse direction for the sampled Gaussian), so it serves as either."""
    return rdp_of_history(coarsen_history(history, MAX_DISTINCT_PAIRS), orders)


def _epsilon_per_order(rdp: np.ndarray, orders: np.ndarray, delta: float, conversion: str) -> np.ndarray:
    if conversion == "classic":
        return rdp + math.log(1 / delta) / (orders - 1)
    if conversion == "tight":
        return rdp + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    raise PrivacyError(f"conversion={conversion!r} is unknown: use one of {CONVERSIONS}.")


def rdp_to_epsilon(rdp: np.ndarray, orders: Sequence[float], delta: float,
                   conversion: str = "tight") -> tuple[float, float]:
    """(epsilon, optimal order) from composed RDP values [len(orders)] at `delta`."""
    orders_a = np.asarray(orders, dtype=np.float64)
    eps = _epsilon_per_order(np.asarray(rdp, dtype=np.float64), orders_a, delta, conversion)
    eps = np.where(np.isnan(eps), math.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(orders_a[best])


def rdp_to_delta(rdp: np.ndarray, orders: Sequence[float], epsilon: float,
                 conversion: str = "tight") -> tuple[float, float]:
    """(delta, optimal order) from composed RDP values [len(orders)] at `epsilon`."""
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if conversion == "classic":
        log_delta = (a - 1) * (r - epsilon)
    elif conversion == "tight":
        log_delta = (a - 1) * (r - epsilon + np.log1p(-1 / a)) - np.log(a)
    else:
        raise PrivacyError(f"conversion={conversion!r} is unknown: use one of {CONVERSIONS}.")
    log_delta = np.where(np.isnan(log_delta), math.inf, log_delta)
    best = int(np.argmin(log_delta))
    return min(1.0, math.exp(min(float(log_delta[best]), 0.0))), float(a[best])


class RDPAccountant(Accountant):
    """Renyi DP accountant (an upper bound on epsilon).

    Histories with more than 128 distinct (sigma, q) pairs (noise schedules) are coarsened to a
    dominating history (groups of nearby pairs, each with its smallest sigma and largest q; see
    base.coarsen_history) to keep the cost bounded.

    Args:
        orders: RDP orders alpha > 1 to optimise over (default: 1.01..10.9 fractional, 11..63,
            and 64..1024).
        conversion: "tight" (Balle et al. 2020, default) or "classic" (Mironov 2017).
    """

    name = "rdp"
    approximate = False

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS, conversion: str = "tight") -> None:
        super().__init__()
        if conversion not in CONVERSIONS:
            raise PrivacyError(f"conversion={conversion!r} is unknown: use one of {CONVERSIONS}.")
        self.orders = check_orders(orders)
        self.conversion = conversion

    def get_rdp(self) -> np.ndarray:
        """Composed RDP of the history at each order, shape [len(self.orders)] (histories with more
        than MAX_DISTINCT_PAIRS distinct (sigma, q) are first coarsened to a dominating one)."""
        return self._rdp(self._history)

    def get_epsilon_and_order(self, delta: float, conversion: str | None = None) -> tuple[float, float]:
        """(epsilon, optimal RDP order) at `delta`."""
        d = check_delta(delta)
        return rdp_to_epsilon(self.get_rdp(), self.orders, d, conversion or self.conversion)

    def get_epsilon(self, delta: float, conversion: str | None = None) -> float:  # type: ignore[override]
        """Epsilon at `delta` with the tight (default) or "classic" RDP conversion."""
        if conversion is None or conversion == self.conversion:
            return super().get_epsilon(delta)
        other = RDPAccountant(self.orders, conversion)
        other._history = self._history
        return other.get_epsilon(delta)

    def _rdp(self, runs: History) -> np.ndarray:
        return history_rdp(runs, self.orders)

    def _epsilon(self, runs: History, delta: float) -> float:
        return rdp_to_epsilon(self._rdp(runs), self.orders, delta, self.conversion)[0]

    def _delta(self, runs: History, epsilon: float) -> float:
        check_epsilon(epsilon)
        return rdp_to_delta(self._rdp(runs), self.orders, epsilon, self.conversion)[0]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(orders=list(self.orders), conversion=self.conversion)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        conversion = state_dict.get("conversion", self.conversion)
        if conversion not in CONVERSIONS:
            raise PrivacyError(f"state_dict['conversion']={conversion!r} is unknown: use one of {CONVERSIONS}.")
        orders = check_orders(state_dict.get("orders", self.orders))
        super().load_state_dict(state_dict)
        self.orders, self.conversion = orders, conversion
