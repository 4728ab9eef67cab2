"""The f-DP analysis of a one-run audit (Mahloujifar, Melis and Chaudhuri, arXiv:2410.22235).

Same game as `dptrain.audit.bound`: m canaries, each included with probability 1/2, r
non-abstaining guesses of which v are correct. Instead of an (epsilon, delta) guarantee, the null
hypothesis is "the run is f-DP with respect to each canary" for a tradeoff function f; here the
Gaussian family f = G_mu (mu-GDP), the shape of the Gaussian mechanism's own tradeoff curve.

Write g(x) = 1 - f(x), the largest power a test of level x can have against one canary
(concave, g(0) = 0; for G_mu, g(x) = Phi(Phi^-1(x) + mu)). Let W be the number of correct
guesses and, for i = 0..v,

    r_i = E[W ; W >= i] / m,    h_i = E[r - W ; W >= i] / m

(the correct and the wrong guesses made in outcomes with at least i correct, per canary). For a
canary j, "guess j and at least i - 1 other guesses correct" is a test of canary j's inclusion
(the other canaries' inclusion held fixed); averaging f-DP over the m canaries and the two sides
of each guess (g is concave) gives, for every i >= 1,

    r_i <= g(h_{i-1}),    i.e.  h_{i-1} >= g^-1(r_i).

If P[W >= v] >= tau, moving the mass above v down to v keeps these constraints for i <= v, and
scaling the distribution by tau / P[W >= v] keeps them too (g concave with g(0) = 0). So a
sub-probability vector (p_0..p_v) with p_v = tau would meet every constraint with total mass
<= 1. The recursion of the paper (its "audit_rh_with_cap") computes the least total mass such a
vector needs: start at r_v = tau v / m, h_v = tau (r - v) / m and for i = v..1 take the smallest
h_{i-1} = max(h_i, g^-1(r_i)); since r_{i-1} - r_i = (i-1) p_{i-1} / m and h_{i-1} - h_i =
(r - i + 1) p_{i-1} / m,

    r_{i-1} = r_i + (i - 1) / (r - i + 1) * (h_{i-1} - h_i).

The total mass is m (r_0 + h_0) / r. If it exceeds 1, P[W >= v] < tau for every f-DP run: v
correct guesses reject the null at level tau. (Choosing each h_{i-1} as small as allowed gives
the least total: tests/audit/test_fdp.py checks it against the convex program it solves.)

The lower bound at confidence 1 - alpha is the largest mu whose null is rejected at tau = alpha;
a larger mu makes g larger and every constraint easier, so the rejected mus form an interval
[0, mu*) located by bisection. A run that is mu-GDP yields a bound above mu with probability at
most alpha. Its epsilon is that of mu*-GDP at the run's delta (`gdp_epsilon`): the epsilon a
Gaussian mechanism with the rejected mu would claim. It contradicts an (epsilon, delta) claim
only for a run that is Gaussian-DP at the claimed epsilon (a full-batch DP-SGD run is exactly
mu-GDP with mu = sqrt(T) / sigma); a mechanism of another shape (randomized response, or
Poisson-subsampled steps in the far tail) can be (epsilon, delta)-DP without being GDP at the
same epsilon, which is why the audit's verdict rests on the (epsilon, delta) bound of
`dptrain.audit.bound` and reports this one beside it (see docs/auditing.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from statistics import NormalDist

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.audit.bound import (
    _check_counts,
    _check_delta,
    bonferroni_confidence,
    check_confidence,
)

#: Largest mu searched: Phi^-1 of a float64 probability lies in [-38.5, 8.3], so a larger mu
#: makes g^-1 vanish on every probability the recursion meets: nothing more can be rejected.
_MU_CAP = 64.0
_TOLERANCE = 1e-7
_STANDARD = NormalDist()


def _phi(x: float) -> float:
    """The standard normal CDF, accurate in both tails."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_power_inverse(mu: float) -> Callable[[float], float]:
    """g^-1 for mu-GDP: the level x a test needs to reach power y, Phi(Phi^-1(y) - mu)."""

    def inverse(power: float) -> float:
        if power <= 0.0:
            return 0.0
        if power >= 1.0:
            return 1.0
        return _phi(_STANDARD.inv_cdf(power) - mu)

    return inverse


def minimal_mass(canaries: int, guesses: int, correct: int, tau: float,
                 power_inverse: Callable[[float], float]) -> float:
    """The least total probability mass an f-DP run needs to show `correct` of `guesses`
    correct guesses with probability tau (see module doc); above 1: rejected at level tau.

    Args:
        canaries, guesses, correct: m, r, v.
        tau: the level, in (0, 1).
        power_inverse: g^-1 of the null's tradeoff function f, g = 1 - f.

    Returns:
        m (r_0 + h_0) / r; the recursion stops as soon as the total exceeds 1 (the answer is
        then a value above 1, not necessarily the full total).
    """
    _check_counts(canaries, guesses, correct)
    if correct == 0:
        return tau
    rate = canaries / guesses
    right, wrong = tau * correct / canaries, tau * (guesses - correct) / canaries
    for i in range(correct, 0, -1):
        needed = power_inverse(right)
        if needed <= wrong:  # nothing changes from here on: r and h stay as they are
            break
        right += (i - 1) / (guesses - i + 1) * (needed - wrong)
        wrong = needed
        if (right + wrong) * rate > 1.0:
            break
    return (right + wrong) * rate


def gdp_rejected(canaries: int, guesses: int, correct: int, mu: float, alpha: float) -> bool:
    """True when `correct` of `guesses` correct guesses reject "the run is mu-GDP" at alpha."""
    return minimal_mass(canaries, guesses, correct, alpha, gaussian_power_inverse(mu)) > 1.0


def gdp_mu_lower_bound(canaries: int, guesses: int, correct: int,
                       confidence: float = 0.95) -> float:
    """The largest mu whose "mu-GDP" null `correct` of `guesses` correct guesses reject at
    `confidence` (0.0 when even mu = 0, no leak at all, is plausible); unitless."""
    alpha = 1.0 - check_confidence(confidence)
    _check_counts(canaries, guesses, correct)
    if not gdp_rejected(canaries, guesses, correct, 0.0, alpha):
        return 0.0
    low, high = 0.0, 1.0
    while high < _MU_CAP and gdp_rejected(canaries, guesses, correct, high, alpha):
        low, high = high, 2.0 * high
    if high >= _MU_CAP:
        return _MU_CAP
    while high - low > _TOLERANCE:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if gdp_rejected(canaries, guesses, correct, mid, alpha) \
            else (low, mid)
    return low


def mu_to_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at `delta`; at delta = 0 no finite epsilon for mu > 0 (inf)."""
    delta = _check_delta(delta)
    if delta == 0.0:
        return math.inf if mu > 0 else 0.0
    return gdp_epsilon(mu, delta)


def fdp_epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float,
                            confidence: float = 0.95) -> float:
    """The epsilon at `delta` of the largest rejected mu-GDP (`gdp_mu_lower_bound`)."""
    return mu_to_epsilon(gdp_mu_lower_bound(canaries, guesses, correct, confidence), delta)


def best_gdp_mu_lower_bound(canaries: int, outcomes: Sequence[tuple[int, int, int]],
                            confidence: float = 0.95) -> tuple[int, list[float]]:
    """The best mu bound over k pre-declared rules, each tested at 1 - alpha / k (Bonferroni).

    Args:
        canaries: m.
        outcomes: (k+, k-, correct) for each rule, declared before looking at the scores.
        confidence: the overall confidence 1 - alpha of the reported (best) bound.

    Returns:
        (the index of the rule with the largest bound, every rule's mu bound in order).
    """
    per_rule = bonferroni_confidence(confidence, len(outcomes))
    bounds = [gdp_mu_lower_bound(canaries, k_plus + k_minus, correct, per_rule)
              for k_plus, k_minus, correct in outcomes]
    best = max(range(len(bounds)), key=lambda k: (bounds[k], -sum(outcomes[k][:2])))
    return best, bounds
