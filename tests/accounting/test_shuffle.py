"""Shuffled batches: each epoch one Gaussian mechanism of sensitivity 2C, composed over epochs."""

import math

import dp_accounting
import pytest
from scipy import optimize, stats

from dptrain.accounting import compute_epsilon, get_accountant, get_noise_multiplier
from dptrain.accounting.shuffle import epoch_sigmas, shuffle_epsilon


def _closed_form(mu: float, delta: float) -> float:
    """epsilon of mu-GDP at delta (Dong, Roth, Su), solved independently with brentq."""
    def excess(eps: float) -> float:
        return (stats.norm.cdf(-eps / mu + mu / 2)
                - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta)
    return optimize.brentq(excess, 0.0, 200.0, xtol=1e-13)


@pytest.mark.parametrize("sigma, q, epochs", [(1.0, 0.1, 3), (2.0, 0.01, 20), (0.8, 0.5, 1)])
def test_shuffled_epsilon_is_the_composed_gaussian_closed_form(sigma, q, epochs):
    steps = epochs * math.ceil(1 / q)
    mu = math.sqrt(epochs) * 2.0 / sigma
    eps = shuffle_epsilon([(sigma, q, steps)], 1e-5)
    assert eps == pytest.approx(_closed_form(mu, 1e-5), rel=1e-8)


@pytest.mark.parametrize("sigma, epochs", [(1.0, 3), (2.0, 20)])
def test_shuffled_epsilon_matches_dp_accounting_and_is_never_below_it(sigma, epochs):
    q = 0.1
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma / 2.0), epochs)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event)
    rdp = dp_accounting.rdp.RdpAccountant().compose(event)
    ours = compute_epsilon([(sigma, q, epochs * 10)], 1e-5, "prv", sampling="shuffle")
    assert ours == pytest.approx(pld.get_epsilon(1e-5), rel=1e-3)
    assert ours <= rdp.get_epsilon(1e-5)
    assert ours >= _closed_form(math.sqrt(epochs) * 2.0 / sigma, 1e-5) * (1 - 1e-12)


def test_a_partial_epoch_is_charged_as_a_whole_one():
    assert epoch_sigmas([(1.0, 0.1, 11)]) == [1.0, 1.0]


def test_an_epoch_is_charged_at_its_smallest_sigma():
    assert epoch_sigmas([(2.0, 0.25, 3), (1.0, 0.25, 1), (3.0, 0.25, 4)]) == [1.0, 3.0]


def test_every_accountant_gives_the_same_shuffled_epsilon():
    history = [(1.2, 0.05, 100)]
    values = {name: compute_epsilon(history, 1e-6, name, sampling="shuffle")
              for name in ("prv", "rdp", "gdp")}
    assert len(set(values.values())) == 1


def test_a_shuffled_accountant_keeps_the_configured_name():
    acc = get_accountant("rdp", "shuffle")
    acc.step(noise_multiplier=1.0, sample_rate=0.5, steps=4)
    assert acc.name == "rdp" and acc.get_epsilon(1e-5) == shuffle_epsilon([(1.0, 0.5, 4)], 1e-5)


def test_calibration_for_shuffled_batches_meets_the_target():
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1,
                                 epochs=5, accountant="prv", sampling="shuffle")
    eps = shuffle_epsilon([(sigma, 0.1, 50)], 1e-5)
    assert 3.0 - 0.01 <= eps <= 3.0
