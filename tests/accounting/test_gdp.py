"""GaussianAccountant: the CLT mu, the mu-GDP conversion, and its approximation warning."""

import math

import pytest
from scipy import stats

from dptrain.accounting import GaussianAccountant, RDPAccountant
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon, gdp_mu


def test_mu_follows_bu_et_al_formula():
    acc = GaussianAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=0.004, steps=10_000)
    assert acc.get_mu() == pytest.approx(0.004 * math.sqrt(10_000 * math.expm1(1 / 1.1**2)), rel=1e-12)


def test_mu_of_a_mixed_history_adds_squares_over_runs():
    mu = gdp_mu([(1.0, 0.01, 100), (2.0, 0.05, 30)])
    expected = math.sqrt(0.01**2 * 100 * math.expm1(1.0) + 0.05**2 * 30 * math.expm1(0.25))
    assert mu == pytest.approx(expected, rel=1e-12)


def test_gdp_delta_matches_the_dong_roth_su_formula():
    mu, eps = 0.8, 1.3
    expected = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
    assert gdp_delta(mu, eps) == pytest.approx(expected, rel=1e-10)


def test_gdp_epsilon_inverts_gdp_delta():
    eps = gdp_epsilon(1.5, 1e-6)
    assert gdp_delta(1.5, eps) == pytest.approx(1e-6, rel=1e-6)


def test_every_epsilon_comes_with_an_approximation_warning():
    acc = GaussianAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=1000)
    with pytest.warns(UserWarning, match="not an upper bound"):
        acc.get_epsilon(1e-5)


def test_gdp_is_flagged_approximate_and_the_others_are_not():
    assert GaussianAccountant.approximate and not RDPAccountant.approximate


@pytest.mark.filterwarnings("ignore:gdp accountant")
def test_gdp_is_close_to_rdp_for_many_small_steps_but_not_above_it():
    gdp, rdp = GaussianAccountant(), RDPAccountant()
    for acc in (gdp, rdp):
        acc.step(noise_multiplier=1.0, sample_rate=0.001, steps=100_000)
    assert 0.6 * rdp.get_epsilon(1e-5) < gdp.get_epsilon(1e-5) < rdp.get_epsilon(1e-5)


def test_tiny_sigma_gives_infinite_mu_and_epsilon():
    assert gdp_mu([(0.01, 0.1, 10)]) == math.inf
    assert gdp_epsilon(math.inf, 1e-5) == math.inf
