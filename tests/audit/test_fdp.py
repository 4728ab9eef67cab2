"""The f-DP (Gaussian-DP) bound of a one-run audit: the recursion, the mu and epsilon bounds."""

import math
from statistics import NormalDist

import numpy as np
import pytest
from scipy import optimize

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.audit.bound import epsilon_lower_bound
from dptrain.audit.fdp import (
    best_gdp_mu_lower_bound,
    fdp_epsilon_lower_bound,
    gaussian_power_inverse,
    gdp_mu_lower_bound,
    gdp_rejected,
    minimal_mass,
)
from dptrain.audit.result import GuessingRules, count_correct
from dptrain.errors import ConfigError

_NORMAL = NormalDist()


def _no_leak(power):
    """g^-1 of the identity tradeoff function f(x) = 1 - x (0-GDP: the run reveals nothing)."""
    return power


@pytest.mark.parametrize("guesses", [1, 2, 5, 12])
def test_without_any_leak_all_correct_guesses_need_tau_times_two_to_the_r(guesses):
    # mu = 0: the constraints hold with equality for Binomial(r, 1/2), so the least mass that
    # shows r of r correct with probability tau is tau / P[Bin(r, 1/2) = r] = tau 2^r.
    tau = 2.0**-14  # small enough that the total stays below 1 (where the recursion stops)
    assert minimal_mass(50, guesses, guesses, tau, _no_leak) == pytest.approx(
        tau * 2**guesses, rel=1e-12)


def test_a_bound_is_positive_exactly_when_all_correct_guesses_are_rarer_than_alpha():
    # Without a leak r of r guesses are all correct with probability 2^-r: 1/16 > 0.05 cannot
    # be rejected at 95%, 1/32 < 0.05 can.
    assert gdp_mu_lower_bound(100, 4, 4, 0.95) == 0.0
    assert gdp_mu_lower_bound(100, 5, 5, 0.95) > 0.0


def test_two_of_two_correct_guesses_match_the_hand_worked_recursion():
    # m = r = v = 2: r_2 = tau, h_2 = 0; h_1 = x = g^-1(tau), r_1 = tau + x; h_0 = g^-1(tau + x),
    # so the least mass is tau + x + g^-1(tau + x), and the bound is the mu where it equals 1.
    tau = 0.3

    def excess(mu):
        inverse = gaussian_power_inverse(mu)
        x = inverse(tau)
        return tau + x + inverse(tau + x) - 1.0

    expected = optimize.brentq(excess, 0.0, 5.0, xtol=1e-12)
    assert gdp_mu_lower_bound(2, 2, 2, 1 - tau) == pytest.approx(expected, abs=1e-6)


def test_no_correct_guess_or_a_single_guess_bounds_nothing():
    assert gdp_mu_lower_bound(1000, 100, 0, 0.95) == 0.0
    assert gdp_mu_lower_bound(1000, 1, 1, 0.95) == 0.0
    assert gdp_mu_lower_bound(1000, 100, 50, 0.95) == 0.0


def test_the_gaussian_power_inverse_undoes_the_power_of_mu_gdp():
    # The power of a level-x test against mu-GDP is 1 - G_mu(x) = Phi(Phi^-1(x) + mu).
    inverse = gaussian_power_inverse(1.3)
    for level in (1e-9, 1e-3, 0.2, 0.7):
        power = _NORMAL.cdf(_NORMAL.inv_cdf(level) + 1.3)
        assert inverse(power) == pytest.approx(level, rel=1e-9)


@pytest.mark.parametrize("case", [(12, 9, 8, 0.05, 0.2), (9, 6, 5, 0.15, 0.1),
                                  (20, 10, 8, 0.1, 0.15), (10, 8, 8, 0.01, 0.4)])
def test_the_recursion_is_the_least_mass_the_fdp_constraints_allow(case):
    # The constraints r_i <= g(h_{i-1}) (i = 1..v) on p_0..p_{v-1} >= 0 with p_v = tau are
    # convex (g is concave); minimising the total mass numerically must give the recursion's.
    m, r, v, tau, mu = case
    power = lambda x: _NORMAL.cdf(_NORMAL.inv_cdf(min(max(x, 1e-300), 1 - 1e-16)) + mu)
    counts = np.arange(v + 1)

    def masses(p):
        full = np.append(p, tau)
        right = [(counts[i:] * full[i:]).sum() / m for i in range(v + 1)]
        wrong = [((r - counts[i:]) * full[i:]).sum() / m for i in range(v + 1)]
        return right, wrong

    constraints = [{"type": "ineq", "fun": lambda p, i=i: power(masses(p)[1][i - 1])
                    - masses(p)[0][i]} for i in range(1, v + 1)]
    best = min(optimize.minimize(lambda p: p.sum() + tau, np.full(v, start), method="SLSQP",
                                 bounds=[(0, 2)] * v, constraints=constraints,
                                 options={"ftol": 1e-13, "maxiter": 1000}).fun
               for start in (0.05, 0.3, 1.0))
    assert 0.1 < best < 1  # below 1: the recursion runs to the end; above tau: it does work
    assert minimal_mass(m, r, v, tau, gaussian_power_inverse(mu)) == pytest.approx(best,
                                                                                   rel=1e-5)


def test_more_correct_guesses_never_lower_the_bound():
    bounds = [gdp_mu_lower_bound(1000, 200, v, 0.95) for v in range(100, 201, 5)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[0] == 0.0 < bounds[-1]


def test_the_bound_is_the_last_mu_whose_null_is_rejected():
    mu = gdp_mu_lower_bound(1000, 200, 180, 0.95)
    assert gdp_rejected(1000, 200, 180, mu, 0.05)
    assert not gdp_rejected(1000, 200, 180, mu + 1e-4, 0.05)


def test_the_epsilon_bound_is_the_epsilon_of_the_mu_bound_at_delta():
    mu = gdp_mu_lower_bound(1000, 200, 180, 0.95)
    assert fdp_epsilon_lower_bound(1000, 200, 180, 1e-5, 0.95) == gdp_epsilon(mu, 1e-5)


def test_at_delta_zero_a_positive_mu_bound_allows_no_finite_epsilon():
    assert fdp_epsilon_lower_bound(1000, 200, 180, 0.0) == math.inf
    assert fdp_epsilon_lower_bound(1000, 200, 100, 0.0) == 0.0


def test_the_fdp_bound_of_a_gaussian_release_is_tighter_than_the_epsilon_delta_bound():
    # The case the f-DP analysis was made for: 180 of the top 200 of 1000 canaries correct.
    assert fdp_epsilon_lower_bound(1000, 200, 180, 1e-5) > 1.5 * epsilon_lower_bound(
        1000, 200, 180, 1e-5)


def _gaussian_audit(mu, canaries, rng):
    """The f-DP mu bound of one audit of a mu-GDP mechanism (each canary's score is
    mu * [included] + N(0, 1)), best of the default rules with the Bonferroni correction."""
    included = rng.random(canaries) < 0.5
    scores = mu * included + rng.standard_normal(canaries)
    outcomes = [(k_plus, k_minus, count_correct(scores, included, k_plus, k_minus))
                for k_plus, k_minus in GuessingRules().counts(canaries)]
    best, bounds = best_gdp_mu_lower_bound(canaries, outcomes, 0.95)
    return bounds[best]


@pytest.mark.parametrize("mu", [0.5, 2.0])
def test_bound_exceeds_the_true_mu_at_most_alpha_of_the_time_for_the_gaussian_mechanism(mu):
    # A Gaussian release with mean shift mu is exactly mu-GDP: at 95% confidence the audit's
    # bound (best of the 10 default rules) may exceed mu in at most 5% of audits.
    rng = np.random.default_rng(0)
    trials = 300
    bounds = np.array([_gaussian_audit(mu, 1000, rng) for _ in range(trials)])
    assert np.mean(bounds > mu) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.median(bounds) > 0.25 * mu  # and it is not vacuous


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5])
def test_confidence_outside_the_open_unit_interval_is_refused(confidence):
    with pytest.raises(ConfigError, match="confidence"):
        gdp_mu_lower_bound(100, 10, 10, confidence)


def test_more_correct_guesses_than_guesses_are_refused():
    with pytest.raises(ConfigError, match="correct <= guesses <= canaries"):
        gdp_mu_lower_bound(10, 5, 6)


def test_the_bound_matches_jax_privacy_on_fixed_scores():
    # JAX Privacy's CanaryScoreAuditor.epsilon_one_run_fdp (Gaussian family, epsilon at delta)
    # with an explicit threshold guesses "included" for every score above it: our top-k rule.
    auditing = pytest.importorskip("jax_privacy.auditing")
    rng = np.random.default_rng(7)
    included = rng.random(2000) < 0.5
    scores = 1.5 * included + rng.standard_normal(2000)
    order = np.sort(scores)[::-1]
    auditor = auditing.CanaryScoreAuditor(scores[included], scores[~included])
    for guesses in (20, 100, 400):
        correct = int(included[scores >= order[guesses - 1]].sum())
        theirs = auditor.epsilon_one_run_fdp(
            0.05, 1e-5, threshold_strategy=auditing.Explicit(float(order[guesses - 1])))
        ours = fdp_epsilon_lower_bound(2000, guesses, correct, 1e-5, 0.95)
        assert ours > 0
        assert ours == pytest.approx(theirs, rel=1e-4)
