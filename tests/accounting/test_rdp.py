"""RDPAccountant: exact RDP of the sampled Gaussian, conversions, published figures, speed."""

import math

import dp_accounting  # test-only dependency (pyproject [test]): the independent accountant
from dp_accounting.rdp import rdp_privacy_accountant as tf_rdp
import numpy as np
import pytest
from scipy import integrate, stats

from dptrain.accounting import RDPAccountant
from dptrain.accounting.rdp import DEFAULT_ORDERS, rdp_sampled_gaussian
from dptrain.errors import PrivacyError


def rdp_by_integration(q: float, sigma: float, alpha: float) -> float:
    """D_alpha(P || Q), P = (1-q) N(0, s^2) + q N(1, s^2), Q = N(0, s^2), by quadrature."""
    def log_integrand(x):
        log_ratio = np.log1p(q * np.expm1((2 * x - 1) / (2 * sigma**2)))
        return stats.norm.logpdf(x, scale=sigma) + alpha * log_ratio

    lo, hi = -30 * sigma, alpha + 30 * sigma
    peak = float(np.max(log_integrand(np.linspace(lo, hi, 20001))))
    value, _ = integrate.quad(lambda x: math.exp(log_integrand(x) - peak), lo, hi,
                              points=[0.0, 0.5, 1.0, alpha], limit=400, epsabs=0, epsrel=1e-13)
    return (math.log(value) + peak) / (alpha - 1)


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.004, 1.1), (0.5, 0.3), (0.1, 0.5), (1e-4, 0.4)])
@pytest.mark.parametrize("alpha", [1.01, 1.5, 2.5, 7.3, 10.9, 2.0, 12.0])
def test_rdp_matches_numerical_integration_and_never_falls_below_it(q, sigma, alpha):
    ours = rdp_sampled_gaussian(q, sigma, [alpha])[0]
    truth = rdp_by_integration(q, sigma, alpha)
    assert ours == pytest.approx(truth, rel=1e-7)
    assert ours >= truth * (1 - 1e-10)


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.004, 1.1), (0.2, 0.7), (1.0, 2.0)])
def test_rdp_equals_dp_accounting_at_integer_orders(q, sigma):
    orders = [2.0, 3.0, 8.0, 32.0, 64.0, 256.0]
    theirs = tf_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)
    np.testing.assert_allclose(rdp_sampled_gaussian(q, sigma, orders), theirs, rtol=1e-10)


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.004, 1.1), (0.2, 0.7)])
def test_rdp_at_fractional_orders_is_at_most_dp_accounting_which_is_conservative(q, sigma):
    orders = [1.05, 1.5, 2.5, 5.5]
    theirs = tf_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)
    assert np.all(rdp_sampled_gaussian(q, sigma, orders) <= theirs * (1 + 1e-9))


@pytest.mark.parametrize("q, sigma, steps, delta", [
    (0.01, 1.0, 1000, 1e-5), (0.004, 1.1, 10_000, 1e-5), (0.1, 0.8, 100, 1e-6),
    (0.5, 2.0, 50, 1e-5), (1.0, 5.0, 10, 1e-3),
])
def test_tight_epsilon_matches_dp_accounting_rdp_accountant_on_integer_orders(q, sigma, steps, delta):
    orders = [float(a) for a in range(2, 257)]
    ours = RDPAccountant(orders=orders)
    ours.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    theirs = tf_rdp.RdpAccountant(orders)
    theirs.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert ours.get_epsilon(delta) == pytest.approx(theirs.get_epsilon(delta), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("sigma, epochs, published", [(1.12, 60, 2.92), (0.6, 30, 9.74), (1.2, 10, 1.20)])
def test_classic_conversion_reproduces_tf_privacy_mnist_tutorial_table(sigma, epochs, published):
    # tensorflow/privacy tutorials/README.md: N = 60000, batch 256, delta = 1e-5
    acc = RDPAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=256 / 60000, steps=epochs * 60000 // 256)
    assert acc.get_epsilon(1e-5, conversion="classic") == pytest.approx(published, abs=0.02)


def test_classic_conversion_reproduces_abadi_et_al_moments_accountant_figure():
    # Abadi et al. 2016, Sec. 3.1: q = 0.01, sigma = 4, delta = 1e-5, T = 10000 -> eps ~ 1.26
    acc = RDPAccountant()
    acc.step(noise_multiplier=4.0, sample_rate=0.01, steps=10_000)
    assert acc.get_epsilon(1e-5, conversion="classic") == pytest.approx(1.26, abs=0.01)


def test_tight_conversion_is_below_classic_conversion():
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=5000)
    assert acc.get_epsilon(1e-5) < acc.get_epsilon(1e-5, conversion="classic")


def test_optimal_order_is_reported_and_attains_the_epsilon():
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=0.004, steps=10_000)
    eps, order = acc.get_epsilon_and_order(1e-5)
    assert order in DEFAULT_ORDERS
    single = RDPAccountant(orders=[order])
    single.step(noise_multiplier=1.1, sample_rate=0.004, steps=10_000)
    assert single.get_epsilon(1e-5) == pytest.approx(eps, rel=1e-12)


def test_mixed_history_composes_by_summing_rdp_over_runs():
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=300)
    acc.step(noise_multiplier=2.0, sample_rate=0.05, steps=100)
    expected = 300 * rdp_sampled_gaussian(0.01, 1.0) + 100 * rdp_sampled_gaussian(0.05, 2.0)
    np.testing.assert_allclose(acc.get_rdp(), expected, rtol=1e-12)


def test_small_sigma_and_large_sample_rate_give_a_finite_epsilon():
    acc = RDPAccountant()
    acc.step(noise_multiplier=0.3, sample_rate=0.5, steps=100)
    assert math.isfinite(acc.get_epsilon(1e-5)) and acc.get_epsilon(1e-5) > 0


def test_a_million_identical_steps_are_one_run_of_the_history():
    # how long accounting takes is measured by scripts/benchmark_accounting.py, not by a timed test
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.3, sample_rate=0.0013, steps=1_000_000)
    assert acc.history == [(1.3, 0.0013, 1_000_000)]
    assert math.isfinite(acc.get_epsilon(1e-6))


def test_unknown_conversion_raises_privacy_error():
    with pytest.raises(PrivacyError, match="conversion"):
        RDPAccountant(conversion="loose")


def test_orders_at_or_below_one_raise_privacy_error():
    with pytest.raises(PrivacyError, match="orders"):
        RDPAccountant(orders=[0.5, 2.0])
