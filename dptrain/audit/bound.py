"""The statistics of a one-run privacy audit (Steinke, Nasr and Jagielski, NeurIPS 2023).

The audit inserts m canaries, includes each independently with probability 1/2 (S_i = +1 or -1,
uniform), trains once, and guesses T_i in {-1, 0, +1} for each canary (0: abstain) with at most
r non-abstentions. W = #{i : T_i = S_i != 0} is the number of correct guesses.

Theorem (arXiv:2305.08846, Theorem 5.2; for delta = 0 it is Theorem 3.1): if the training run
is (epsilon, delta)-DP with respect to each canary, then for every v,

    P[W >= v] <= f(v) + 2 m delta * max_{i = 1..m} (f(v - i) - f(v)) / i,

    f(k) = P[Binomial(r, e^eps / (1 + e^eps)) >= k].

The right side is the p-value of observing v correct guesses under the null hypothesis "the run
is (epsilon, delta)-DP". The lower bound at confidence 1 - alpha is the largest epsilon whose
null is still rejected, sup {epsilon : p(epsilon) <= alpha}: every smaller epsilon is rejected
too, because an (epsilon', delta)-DP run is also (epsilon, delta)-DP for every epsilon >
epsilon' (so the sup is a valid bound even where the right side is not monotone in epsilon).
Equivalently it is where the observed count stops being implausible: at every larger epsilon
the observation has probability above alpha. With probability at least 1 - alpha over the
canaries' inclusion and the run's randomness, a run that is (epsilon, delta)-DP yields a bound
<= epsilon.

Several guessing rules (e.g. how many top scores to guess) declared before the run may be tried
on the same scores: each is tested at level alpha / k (Bonferroni correction, k rules) and the
best bound is reported. The union bound keeps the probability that ANY of them exceeds the true
epsilon below alpha, so the best of them is a valid bound at confidence 1 - alpha.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from dptrain.errors import ConfigError

#: Number of grid points scanned for the last epsilon whose null is rejected (see
#: `epsilon_lower_bound`); the crossing is then refined by bisection to `_TOLERANCE`.
_GRID = 128
_TOLERANCE = 1e-7
_EPSILON_CAP = 200.0  # beyond it e^eps / (1 + e^eps) == 1 in float64: every count is plausible


def check_confidence(confidence: float, argument: str = "confidence") -> float:
    """`confidence` as a float if it lies in (0, 1), else ConfigError naming `argument`."""
    if not (isinstance(confidence, (int, float)) and not isinstance(confidence, bool)
            and 0 < confidence < 1):
        raise ConfigError(f"{argument}={confidence!r} must be a probability in (0, 1) (the "
                          "confidence of the lower bound, e.g. 0.95).")
    return float(confidence)


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
               for n in (canaries, guesses, correct)):
        raise ConfigError(f"canary counts must be integers, got canaries={canaries!r}, "
                          f"guesses={guesses!r}, correct={correct!r}.")
    if not 0 <= correct <= guesses <= canaries:
        raise ConfigError(f"need 0 <= correct <= guesses <= canaries, got correct={correct}, "
                          f"guesses={guesses}, canaries={canaries}.")


def _check_delta(delta: float) -> float:
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise ConfigError(f"delta={delta!r} must be in [0, 1) (the delta of the claimed "
                          "(epsilon, delta) guarantee).")
    return float(delta)


def guess_accuracy(epsilon: float) -> float:
    """e^eps / (1 + e^eps): the accuracy of one guess against eps-DP randomized response."""
    return float(1.0 / (1.0 + math.exp(-epsilon)))


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The theorem's bound on P[W >= correct] for an (epsilon, delta)-DP run, capped at 1.

    Args:
        canaries: m, the number of canaries (each included with probability 1/2).
        guesses: r, the number of non-abstaining guesses.
        correct: v, the number of correct guesses.
        epsilon, delta: the null hypothesis "the run is (epsilon, delta)-DP".
    """
    _check_counts(canaries, guesses, correct)
    delta = _check_delta(delta)
    if correct == 0:
        return 1.0
    accuracy = guess_accuracy(epsilon)
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))  # f(v) = P[Bin >= v]
    if delta == 0:
        return min(1.0, tail)
    # f(v - i) for i = 1..v; for i > v, f(v - i) = 1 and (1 - f(v)) / i is largest at i = v,
    # so the max over i = 1..m is attained in 1..v.
    i = np.arange(1, correct + 1)
    shifted = stats.binom.sf(correct - i - 1, guesses, accuracy)
    slope = float(np.max((shifted - tail) / i))
    return min(1.0, tail + 2.0 * canaries * delta * slope)


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float,
                        confidence: float = 0.95) -> float:
    """The largest epsilon that `correct` of `guesses` correct guesses rejects at `confidence`.

    sup {eps >= 0 : p_value(m, r, v, eps, delta) <= 1 - confidence}, or 0.0 when even eps = 0
    is plausible. The set is located on a grid of `_GRID` points of [0, eps_max] (eps_max: the
    first epsilon at which the delta-free tail f(v) alone exceeds alpha, so no larger one can be
    rejected), and its last crossing refined by bisection. A rejected interval narrower than the
    grid step could only be missed, which lowers (never invalidates) the bound.
    """
    alpha = 1.0 - check_confidence(confidence)
    _check_counts(canaries, guesses, correct)
    delta = _check_delta(delta)

    def rejected(eps: float) -> bool:
        return p_value(canaries, guesses, correct, eps, delta) <= alpha

    eps_max = 1.0
    while eps_max < _EPSILON_CAP and stats.binom.sf(correct - 1, guesses,
                                                    guess_accuracy(eps_max)) <= alpha:
        eps_max *= 2.0
    eps_max = min(eps_max, _EPSILON_CAP)
    grid = np.linspace(0.0, eps_max, _GRID + 1)
    last = None
    for k, eps in enumerate(grid):
        if rejected(float(eps)):
            last = k
    if last is None:
        return 0.0
    if last == len(grid) - 1:
        return float(grid[-1])
    low, high = float(grid[last]), float(grid[last + 1])
    while high - low > _TOLERANCE:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return low


@dataclass(frozen=True)
class GuessOutcome:
    """One pre-declared guessing rule applied to the scores, and the bound it yields.

    The bounds are at the Bonferroni-corrected confidence 1 - alpha / k (k rules): the
    (epsilon, delta) `lower_bound` of this module and the f-DP (Gaussian) bounds of
    `dptrain.audit.fdp` (filled in by `dptrain.audit.result.audit_scores`).
    """

    guesses_included: int   # k+: the highest scores guessed "included"
    guesses_excluded: int   # k-: the lowest scores guessed "excluded"
    correct: int            # v: correct guesses among the r = k+ + k-
    lower_bound: float
    fdp_mu_lower_bound: float = 0.0  # mu-GDP rejected for every smaller mu
    fdp_lower_bound: float = 0.0     # epsilon of that mu-GDP at the run's delta

    @property
    def guesses(self) -> int:
        """r = k+ + k-, the number of non-abstaining guesses."""
        return self.guesses_included + self.guesses_excluded


def bonferroni_confidence(confidence: float, rules: int) -> float:
    """The confidence 1 - alpha / k at which each of k rules is tested."""
    if rules < 1:
        raise ConfigError("at least one guessing rule is needed to compute a lower bound.")
    return 1.0 - (1.0 - check_confidence(confidence)) / rules


def best_lower_bound(canaries: int, outcomes: Sequence[tuple[int, int, int]], delta: float,
                     confidence: float = 0.95) -> tuple[GuessOutcome, tuple[GuessOutcome, ...]]:
    """The best bound over k pre-declared rules, each tested at 1 - alpha / k (Bonferroni).

    Args:
        canaries: m.
        outcomes: (k+, k-, correct) for each rule, declared before looking at the scores.
        delta: the delta of the claimed guarantee.
        confidence: the overall confidence 1 - alpha of the reported (best) bound.

    Returns:
        (the rule with the largest bound, every rule's outcome in the given order).
    """
    per_rule = bonferroni_confidence(confidence, len(outcomes))
    results = tuple(
        GuessOutcome(k_plus, k_minus, correct,
                     epsilon_lower_bound(canaries, k_plus + k_minus, correct, delta, per_rule))
        for k_plus, k_minus, correct in outcomes)
    best = max(results, key=lambda o: (o.lower_bound, -o.guesses))
    return best, results
