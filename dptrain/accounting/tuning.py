"""The privacy cost of hyperparameter tuning: releasing the best of several training runs.

Every run of a sweep trains on the same private data, so releasing the run picked by its
validation or test score costs more than that run's own epsilon. Two bounds:

* **All runs composed** (`composed_epsilon`): the runs' histories concatenated into one and
  accounted as one (any accountant). It holds for any selection rule, whatever the number of runs.
  Runs charged under different analyses (Poisson, random allocation: `composed_rdp_epsilon`)
  compose as RDP curves added in each direction of add/remove, each converted at delta.
* **A random number of runs** (Papernot and Steinke, ICLR 2022, "Hyperparameter tuning with Renyi
  differential privacy"): run K trials, K drawn from `Trials` independently of the data, each with
  hyperparameters drawn from a fixed distribution, and release only the best. If one trial is
  (lambda, eps(lambda))-RDP at every order, whatever hyperparameters it draws (`per_trial_rdp`:
  the worst RDP curve of the histories given; pass one per point of the grid, not only those of
  the trials that ran: an undrawn point that costs more is a trial that could have run),
  repeat-and-select is (lambda, eps'(lambda))-RDP with (`rdp_repeat_and_select`)

      truncated negative binomial (eta, gamma), Theorem 2, minimised over the orders lambda-hat:
          eps'(l) = eps(l) + (1 + eta) (1 - 1/l^) eps(l^) + (1 + eta) log(1/gamma) / l^
                    + log(E[K]) / (l - 1)
      Poisson (mean mu), Theorem 6, with eps^ = log(1 + 1/(l - 1)) and delta^ the per-trial
      delta at eps^:
          eps'(l) = eps(l) + mu delta^ + log(mu) / (l - 1)

  then made non-decreasing in the order (Renyi divergences are). The (epsilon, delta) conversion
  is the RDP accountant's (dptrain.accounting.rdp). Epsilons are in nats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dptrain.accounting.history import History, merge_history
from dptrain.accounting.rdp import (
    DEFAULT_ORDERS,
    DIRECTIONS,
    check_orders,
    rdp_to_delta,
    rdp_to_epsilon,
)
from dptrain.accounting.registry import compute_epsilon
from dptrain.accounting.selections import SelectionAccounting, selection_accounting
from dptrain.checks import check_delta, is_real
from dptrain.errors import PrivacyError

POISSON = "poisson"
TRUNCATED_NEGATIVE_BINOMIAL = "truncated_negative_binomial"
DISTRIBUTIONS = (POISSON, TRUNCATED_NEGATIVE_BINOMIAL)


@dataclass(frozen=True)
class Trials:
    """The distribution of the number K of trials: Poisson with mean `mean_trials` (mu >= 1), or
    truncated negative binomial with shape `eta` > -1 and `gamma` in (0, 1) (P[K = k] is
    proportional to (1 - gamma)^k C(k + eta - 1, k) for k >= 1; eta = 1 is geometric, eta = 0
    logarithmic). Build one with `poisson_trials` or `truncated_negative_binomial_trials`."""

    distribution: str
    mean_trials: float | None = None
    eta: float | None = None
    gamma: float | None = None

    def mean(self) -> float:
        """E[K], the expected number of trials."""
        if self.distribution == POISSON:
            return float(self.mean_trials)
        eta, log_gamma = float(self.eta), math.log(self.gamma)
        if eta == 0.0:                                  # logarithmic distribution
            return (1.0 - self.gamma) / (self.gamma * -log_gamma)
        return eta * (1.0 - self.gamma) / (self.gamma * -math.expm1(eta * log_gamma))

    def to_json(self) -> dict[str, Any]:
        """{"distribution", "mean_trials"} (Poisson) or {"distribution", "eta", "gamma",
        "mean_trials"} (truncated negative binomial; mean_trials is E[K])."""
        if self.distribution == POISSON:
            return {"distribution": POISSON, "mean_trials": float(self.mean_trials)}
        return {"distribution": self.distribution, "eta": float(self.eta),
                "gamma": float(self.gamma), "mean_trials": self.mean()}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Trials:
        """Inverse of `to_json` (checked: PrivacyError naming the bad field)."""
        distribution = record.get("distribution")
        if distribution == POISSON:
            return poisson_trials(record.get("mean_trials"))
        if distribution == TRUNCATED_NEGATIVE_BINOMIAL:
            return truncated_negative_binomial_trials(record.get("eta"), record.get("gamma"))
        raise PrivacyError(f"distribution={distribution!r} is unknown: the number of trials is "
                           f"drawn from one of {', '.join(DISTRIBUTIONS)}.")

    def draw(self, rng: np.random.Generator) -> int:
        """One draw of K from `rng` (for a private sweep: seeded from OS entropy, and secret)."""
        if self.distribution == POISSON:
            return int(rng.poisson(self.mean_trials))
        return _draw_truncated_negative_binomial(float(self.eta), float(self.gamma), rng)


def poisson_trials(mean_trials: Any) -> Trials:
    """K ~ Poisson(mean_trials); PrivacyError unless mean_trials is a finite number >= 1 (the
    domain where dp_accounting's implementation of Theorem 6 agrees with ours)."""
    if not is_real(mean_trials) or not (1 <= mean_trials < math.inf):
        raise PrivacyError(f"mean_trials={mean_trials!r} is invalid: the Poisson number of trials "
                           "needs a finite mean >= 1 (e.g. 5).")
    return Trials(POISSON, mean_trials=float(mean_trials))


def truncated_negative_binomial_trials(eta: Any, gamma: Any) -> Trials:
    """K ~ truncated negative binomial(eta, gamma); PrivacyError unless eta > -1 (finite) and
    0 < gamma < 1."""
    if not is_real(eta) or not (-1 < eta < math.inf):
        raise PrivacyError(f"eta={eta!r} is invalid: the truncated negative binomial needs a "
                           "finite shape eta > -1 (eta = 1: geometric, eta = 0: logarithmic).")
    if not is_real(gamma) or not (0 < gamma < 1):
        raise PrivacyError(f"gamma={gamma!r} is invalid: the truncated negative binomial needs "
                           "gamma in (0, 1) (smaller gamma: more trials; E[K] = 1/gamma for "
                           "eta = 1).")
    return Trials(TRUNCATED_NEGATIVE_BINOMIAL, eta=float(eta), gamma=float(gamma))


def _draw_truncated_negative_binomial(eta: float, gamma: float, rng: np.random.Generator) -> int:
    """Inverse-CDF draw: P[K = 1] = p1, P[K = k+1] = P[K = k] (1 - gamma) (k + eta) / (k + 1)."""
    if eta == 0.0:
        p = (1.0 - gamma) / -math.log(gamma)
    else:
        p = eta * (1.0 - gamma) / math.expm1(-eta * math.log(gamma))
    u, k, cdf = float(rng.random()), 1, p
    while u > cdf and p > 0.0:
        p *= (1.0 - gamma) * (k + eta) / (k + 1)
        k += 1
        cdf += p
    return k


def _non_decreasing(rdp: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """rdp [A] lowered to min over the orders >= each order (RDP grows with the order)."""
    order = np.argsort(orders, kind="stable")
    out = np.empty_like(rdp)
    out[order] = np.minimum.accumulate(rdp[order][::-1])[::-1]
    return out


def rdp_repeat_and_select(per_trial_rdp: Sequence[float], orders: Sequence[float],
                          trials: Trials, conversion: str = "tight") -> np.ndarray:
    """RDP [len(orders)] of running K ~ `trials` trials and releasing only the best, from the RDP
    [len(orders)] of one trial (nats). `conversion` is the RDP-to-delta conversion Theorem 6
    (Poisson) uses for the per-trial delta^ ("tight" or "classic")."""
    orders_a = np.asarray(check_orders(orders), dtype=np.float64)
    rdp = np.asarray(per_trial_rdp, dtype=np.float64)
    if rdp.shape != orders_a.shape:
        raise PrivacyError(f"per_trial_rdp has shape {rdp.shape}, orders {orders_a.shape}: give "
                           "one RDP value per order.")
    log_mean = math.log(trials.mean())
    if trials.distribution == POISSON:
        delta_hat = np.array([rdp_to_delta(rdp, orders_a, math.log1p(1 / (a - 1)), conversion)[0]
                              for a in orders_a])
        out = rdp + trials.mean_trials * delta_hat + log_mean / (orders_a - 1)
    else:
        hat = (1 - 1 / orders_a) * rdp + math.log(1 / trials.gamma) / orders_a
        out = rdp + (1 + trials.eta) * float(np.min(hat)) + log_mean / (orders_a - 1)
    return _non_decreasing(np.where(np.isnan(out), math.inf, out), orders_a)


def _charges(histories: list[History],
             charged_as: Sequence[SelectionAccounting] | None) -> list[SelectionAccounting]:
    """How each of `histories` is charged: `charged_as` (one per history; each must compose,
    SelectionAccounting.rdp), or Poisson DP-SGD for all when None."""
    charges = ([selection_accounting("poisson")] * len(histories) if charged_as is None
               else list(charged_as))
    if len(charges) != len(histories):
        raise PrivacyError(f"charged_as has {len(charges)} entries for {len(histories)} "
                           "histories: give one per history.")
    for charge in charges:
        if not charge.composes:
            raise PrivacyError(f"runs charged as {charge.name} do not compose: "
                               f"{charge.not_composed}.")
    return charges


def composition_orders(charged_as: Iterable[SelectionAccounting],
                       directions: Sequence[str] = DIRECTIONS) -> tuple[float, ...]:
    """The RDP orders at which every one of `charged_as` has a curve in every one of
    `directions` (SelectionAccounting.rdp_orders): DEFAULT_ORDERS when none restricts them
    (Poisson alone), else the orders they share (random allocation: integers)."""
    allowed = [set(map(float, charge.rdp_orders[d])) for charge in charged_as
               if charge.rdp_orders is not None for d in directions]
    if not allowed:
        return DEFAULT_ORDERS
    shared = tuple(sorted(set.intersection(*allowed)))
    if not shared:
        raise PrivacyError("the runs' RDP curves share no order: they cannot be composed.")
    return shared


def _rdp_curve(history: History, charge: SelectionAccounting, orders: tuple[float, ...],
               directions: Sequence[str]) -> np.ndarray:
    """The larger at each order of `history`'s curves [len(orders)] in `directions`."""
    return np.max(np.stack([charge.rdp(history, orders, d) for d in directions]), axis=0)


def per_trial_rdp(histories: Iterable[History], orders: Sequence[float] = DEFAULT_ORDERS,
                  charged_as: Sequence[SelectionAccounting] | None = None) -> np.ndarray:
    """The worst trial's RDP [len(orders)]: the elementwise max of the curves of `histories`
    (Poisson DP-SGD's, the RDP accountant's, or as `charged_as` says, one per history: then
    each curve is the larger of the add/remove pair's two directions, since a trial's RDP must
    hold for either dataset of a pair in either order). Repeat-and-select needs one bound every
    trial satisfies, so `histories` must cover every hyperparameter setting a trial can draw
    (the grid's planned histories), not only the trials that ran."""
    orders_t = check_orders(orders)
    histories = list(histories)
    curves = [_rdp_curve(h, charge, orders_t, DIRECTIONS)
              for h, charge in zip(histories, _charges(histories, charged_as))]
    if not curves:
        raise PrivacyError("per_trial_rdp needs the history of at least one trial.")
    return np.max(np.stack(curves), axis=0)


def repeat_and_select_epsilon(histories: Iterable[History], trials: Trials, delta: float,
                              orders: Sequence[float] | None = None,
                              conversion: str = "tight",
                              charged_as: Sequence[SelectionAccounting] | None = None) -> float:
    """Epsilon (nats) at `delta` of releasing the best of K ~ `trials` trials, each bounded by the
    worst RDP curve of `histories` (the trials' histories, charged as Poisson DP-SGD or as
    `charged_as` says, one per history), at `orders` (default: `composition_orders`)."""
    histories = list(histories)
    charges = _charges(histories, charged_as)
    orders_t = check_orders(composition_orders(charges) if orders is None else orders)
    rdp = rdp_repeat_and_select(per_trial_rdp(histories, orders_t, charges), orders_t, trials,
                                conversion)
    return rdp_to_epsilon(rdp, orders_t, check_delta(delta), conversion)[0]


def compose_histories(histories: Iterable[History]) -> History:
    """One history running every history in turn (composition: their concatenation)."""
    return merge_history(run for history in histories for run in history)


def composed_epsilon(histories: Iterable[History], delta: float, accountant: str = "rdp") -> float:
    """Epsilon (nats) at `delta` of all `histories` composed, under `accountant`: what releasing
    anything chosen from all of them costs at most (Poisson DP-SGD histories, concatenated)."""
    return compute_epsilon(compose_histories(histories), delta, accountant)


def composed_rdp_epsilon(histories: Iterable[History], charged_as: Sequence[SelectionAccounting],
                         delta: float, conversion: str = "tight") -> float:
    """Epsilon (nats) at `delta` of all `histories` composed, each charged as `charged_as` says
    (Poisson, random allocation: any that compose, one per history), under add/remove.

    In each direction of the pair (rdp.REMOVE, rdp.ADD) the runs' RDP curves are added, at the
    orders every run has a curve at in that direction (adaptive composition of Renyi DP: each
    run may depend on the earlier ones' outputs), and converted at `delta`; the larger of the
    two directions' epsilons holds for every ordered pair of neighbouring datasets. Converting
    each direction on its own is never looser than converting the larger curve. 0.0 when no
    history has a step."""
    histories = list(histories)
    charges = _charges(histories, charged_as)
    d = check_delta(delta)
    runs = [(h, c) for h, c in zip(histories, charges) if any(n for _, _, n in h)]
    if not runs:
        return 0.0
    worst = 0.0
    for direction in DIRECTIONS:
        orders = composition_orders([c for _, c in runs], (direction,))
        total = sum((c.rdp(h, orders, direction) for h, c in runs), np.zeros(len(orders)))
        worst = max(worst, rdp_to_epsilon(total, orders, d, conversion)[0])
    return worst
