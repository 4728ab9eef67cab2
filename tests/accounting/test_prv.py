"""PRVAccountant: certified bounds, agreement with dp_accounting's PLD, robustness, speed."""

import math
import warnings

import dp_accounting  # test-only dependency (pyproject [test]): the independent accountant
import pytest

from dptrain.accounting import PRVAccountant, RDPAccountant
from dptrain.accounting import prv as prv_module
from dptrain.accounting.prv import loss_cdf_sf

# Stated tolerance: our upper bound is within PLD_TOLERANCE (nats) + 0.5% above dp_accounting's
# PLD epsilon (value_discretization_interval 1e-4), and our lower bound is below it.
PLD_TOLERANCE = 0.03


def pld_epsilon(history, delta, interval=1e-4):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
    for sigma, q, steps in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def prv_of(history, eps_error=0.01):
    acc = PRVAccountant(eps_error=eps_error)
    for sigma, q, steps in history:
        acc.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    return acc


@pytest.mark.parametrize("history, delta", [
    ([(1.0, 0.01, 1000)], 1e-5),
    ([(1.1, 0.004, 3000)], 1e-6),
    ([(2.0, 1.0, 10)], 1e-5),
    ([(0.8, 0.1, 50)], 1e-6),
])
def test_prv_bounds_bracket_dp_accounting_pld_within_stated_tolerance(history, delta):
    lower, estimate, upper = prv_of(history).get_epsilon_bounds(delta)
    reference = pld_epsilon(history, delta)
    assert lower <= reference <= upper + 1e-9
    assert upper - reference <= PLD_TOLERANCE + 0.005 * reference
    assert estimate == pytest.approx(reference, abs=2e-3, rel=1e-3)


def test_prv_epsilon_is_the_upper_bound_and_below_rdp():
    history = [(1.0, 0.02, 500)]
    acc = prv_of(history)
    rdp = RDPAccountant.from_history(history)
    assert acc.get_epsilon(1e-5) == acc.get_epsilon_bounds(1e-5).upper
    assert acc.get_epsilon(1e-5) < rdp.get_epsilon(1e-5)


def test_large_epsilon_with_small_sigma_and_large_sample_rate_is_finite_and_tight():
    # Opacus issue #591: PRV fails for large epsilons (here eps ~ 75)
    history = [(0.3, 0.5, 10)]
    lower, _, upper = prv_of(history).get_epsilon_bounds(1e-5)
    reference = pld_epsilon(history, 1e-5, interval=1e-3)
    assert math.isfinite(upper) and lower <= reference <= upper + 1e-9
    assert upper - lower < 0.05


def test_long_mixed_history_with_varying_sigma_and_sample_rate_matches_pld():
    # Opacus issue #604: PRV breaks on long histories with changing sigma and q
    history = [(1.0, 0.01, 400), (0.7, 0.02, 60), (1.5, 0.005, 1000), (0.9, 0.01, 200)]
    lower, _, upper = prv_of(history).get_epsilon_bounds(1e-5)
    reference = pld_epsilon(history, 1e-5)
    assert lower <= reference <= upper + 1e-9
    assert upper - reference <= PLD_TOLERANCE + 0.005 * reference


def test_many_distinct_runs_stay_between_their_most_and_least_private_constant_histories():
    history = [(1.0 + 0.002 * i, 0.01, 10) for i in range(50)]   # sigma 1.0 .. 1.098
    upper = prv_of(history).get_epsilon(1e-5)
    assert upper >= pld_epsilon([(1.098, 0.01, 500)], 1e-5)
    assert upper <= pld_epsilon([(1.0, 0.01, 500)], 1e-5) + PLD_TOLERANCE


def test_epsilon_error_shrinks_with_a_finer_requested_error():
    coarse = prv_of([(1.0, 0.01, 1000)], eps_error=0.05).get_epsilon_bounds(1e-5)
    fine = prv_of([(1.0, 0.01, 1000)], eps_error=0.005).get_epsilon_bounds(1e-5)
    assert fine.upper - fine.lower < coarse.upper - coarse.lower
    assert fine.upper < coarse.upper


def test_uncertifiable_computation_falls_back_to_rdp_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise FloatingPointError("simulated overflow")

    monkeypatch.setattr(prv_module, "_bounds_cached", broken)
    history = [(1.0, 0.01, 100)]
    with pytest.warns(UserWarning, match="falls back|RDP"):
        eps = prv_of(history).get_epsilon(1e-5)
    assert eps == RDPAccountant.from_history(history).get_epsilon(1e-5)


def test_loss_distributions_are_valid_cdfs_in_both_directions():
    import numpy as np

    l = np.linspace(-3, 3, 101)
    for direction in ("remove", "add"):
        cdf, sf = loss_cdf_sf(l, 0.8, 0.05, direction)
        np.testing.assert_allclose(cdf + sf, 1.0, atol=1e-14)
        assert np.all(np.diff(cdf) >= -1e-15)


def test_get_delta_bounds_the_delta_of_its_own_epsilon():
    acc = prv_of([(1.0, 0.01, 1000)])
    eps = acc.get_epsilon(1e-5)
    assert acc.get_delta(eps) <= 1e-5 * 1.05
    assert acc.get_delta(eps - 0.1) > 1e-5


def test_hundred_thousand_steps_give_a_finite_epsilon_below_rdp_without_warnings():
    # how long it takes is measured by scripts/benchmark_accounting.py, not by a timed test
    acc = PRVAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=0.004, steps=100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps = acc.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps < RDPAccountant.from_history(acc.history).get_epsilon(1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("steps", [10, 1000, 10000])
@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_prv_grid_against_dp_accounting_pld(q, sigma, steps, delta):
    history = [(sigma, q, steps)]
    lower, _, upper = prv_of(history).get_epsilon_bounds(delta)
    reference = pld_epsilon(history, delta)
    assert lower <= reference + 1e-6
    assert upper >= reference - 1e-6
    assert upper - reference <= PLD_TOLERANCE + 0.005 * reference


def gaussian_mechanism_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with sensitivity / std = mu (Balle & Wang 2018)."""
    from scipy import optimize, stats

    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(excess, 0.0, mu * mu / 2 + 20 * mu + 10, xtol=1e-12)


@pytest.mark.parametrize("sigma, steps", [(0.5, 10), (0.7, 3), (2.0, 100)])
@pytest.mark.parametrize("delta", [1e-5, 1e-10])
def test_without_subsampling_prv_brackets_the_exact_gaussian_mechanism(sigma, steps, delta):
    # q = 1: T steps of sigma are one Gaussian mechanism with mu = sqrt(T) / sigma
    lower, _, upper = prv_of([(sigma, 1.0, steps)]).get_epsilon_bounds(delta)
    exact = gaussian_mechanism_epsilon(math.sqrt(steps) / sigma, delta)
    assert lower <= exact <= upper
    assert upper - exact <= PLD_TOLERANCE


def test_tiny_delta_is_certified_and_brackets_dp_accounting_pld():
    history = [(1.0, 0.1, 1000)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback to RDP
        lower, _, upper = prv_of(history).get_epsilon_bounds(1e-10)
    reference = pld_epsilon(history, 1e-10)
    assert lower <= reference <= upper + 1e-9
    assert upper - reference <= PLD_TOLERANCE


def test_hundred_thousand_steps_bracket_dp_accounting_pld():
    history = [(1.1, 0.004, 100_000)]
    lower, _, upper = prv_of(history).get_epsilon_bounds(1e-5)
    reference = pld_epsilon(history, 1e-5, interval=1e-4)
    assert lower <= reference <= upper + 1e-9
    assert upper - reference <= PLD_TOLERANCE


def test_get_delta_falls_back_to_rdp_with_a_warning_when_the_numerical_method_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(prv_module, "_delta_cached", broken)
    history = [(1.0, 0.01, 100)]
    with pytest.warns(UserWarning, match="RDP delta"):
        delta = prv_of(history).get_delta(2.0)
    assert delta == RDPAccountant.from_history(history).get_delta(2.0)
