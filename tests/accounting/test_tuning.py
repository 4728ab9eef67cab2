"""The cost of releasing the best of several runs (dptrain.accounting.tuning), checked against
Google's dp_accounting (its RDP accountant's RepeatAndSelectDpEvent) on the same per-trial event."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from dptrain.accounting import get_accountant
from dptrain.accounting.rdp import DEFAULT_ORDERS, rdp_of_history
from dptrain.accounting.tuning import (
    Trials,
    compose_histories,
    composed_epsilon,
    composed_rdp_epsilon,
    per_trial_rdp,
    poisson_trials,
    rdp_repeat_and_select,
    repeat_and_select_epsilon,
    truncated_negative_binomial_trials,
)
from dptrain.errors import PrivacyError

DELTA = 1e-5
# (sigma, q, steps, mean number of trials): dp_accounting's series converge at every order here
SETTINGS = [(1.0, 0.01, 1000, 5.0), (2.0, 0.004, 5000, 3.0), (1.5, 0.02, 400, 10.0),
            (1.2, 0.005, 2000, 2.0)]


def _dp_accounting_epsilon(sigma: float, q: float, steps: int, mean: float, shape: float) -> float:
    trial = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    accountant = RdpAccountant(orders=list(DEFAULT_ORDERS))
    accountant.compose(dp_event.RepeatAndSelectDpEvent(trial, mean, shape))
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("sigma,q,steps,mean", SETTINGS)
def test_poisson_number_of_trials_matches_dp_accounting(sigma, q, steps, mean):
    ours = repeat_and_select_epsilon([[(sigma, q, steps)]], poisson_trials(mean), DELTA)
    theirs = _dp_accounting_epsilon(sigma, q, steps, mean, math.inf)
    assert ours == pytest.approx(theirs, rel=1e-3)


@pytest.mark.parametrize("eta", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("sigma,q,steps,mean", SETTINGS)
def test_truncated_negative_binomial_number_of_trials_matches_dp_accounting(
        sigma, q, steps, mean, eta):
    trials = truncated_negative_binomial_trials(eta, 1 / mean if eta == 1 else 0.2)
    ours = repeat_and_select_epsilon([[(sigma, q, steps)]], trials, DELTA)
    theirs = _dp_accounting_epsilon(sigma, q, steps, trials.mean(), eta)
    assert ours == pytest.approx(theirs, rel=1e-3)


def test_the_mean_of_a_truncated_negative_binomial_is_its_closed_form():
    # E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta)); eta = 1: 1/gamma; eta = 0: logarithmic
    assert truncated_negative_binomial_trials(1.0, 0.25).mean() == pytest.approx(4.0)
    assert truncated_negative_binomial_trials(2.0, 0.5).mean() == pytest.approx(2 * 0.5 / (0.5 * 0.75))
    assert truncated_negative_binomial_trials(0.0, 0.5).mean() == pytest.approx(0.5 / (0.5 * math.log(2)))


@pytest.mark.parametrize("trials", [poisson_trials(4.0), truncated_negative_binomial_trials(0.5, 0.2),
                                    truncated_negative_binomial_trials(-0.5, 0.1),
                                    truncated_negative_binomial_trials(0.0, 0.3)])
def test_draws_of_the_number_of_trials_average_to_its_mean(trials):
    rng = np.random.default_rng(0)
    draws = np.array([trials.draw(rng) for _ in range(20000)])
    assert draws.mean() == pytest.approx(trials.mean(), rel=0.03)
    if trials.distribution != "poisson":
        assert draws.min() >= 1


def test_the_worst_trial_bounds_every_trial():
    weak, strong = [(0.8, 0.01, 1000)], [(1.5, 0.01, 1000)]
    assert np.array_equal(per_trial_rdp([strong, weak]), rdp_of_history(weak, DEFAULT_ORDERS))
    trials = poisson_trials(3.0)
    assert repeat_and_select_epsilon([strong, weak], trials, DELTA) == \
        repeat_and_select_epsilon([weak], trials, DELTA)


def test_repeat_and_select_rdp_grows_with_the_order_and_exceeds_one_trial():
    one = rdp_of_history([(1.0, 0.01, 1000)], DEFAULT_ORDERS)
    for trials in (poisson_trials(5.0), truncated_negative_binomial_trials(1.0, 0.2)):
        rdp = rdp_repeat_and_select(one, DEFAULT_ORDERS, trials)
        assert np.all(np.diff(rdp) >= 0) and np.all(rdp >= one)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_all_runs_composed_cost_the_accountants_epsilon_of_their_concatenated_histories(accountant):
    runs = [[(1.0, 0.01, 300)], [(2.0, 0.01, 300), (1.0, 0.02, 50)], [(1.0, 0.01, 300)]]
    expected = get_accountant(accountant)
    for history in runs:
        for sigma, q, steps in history:
            expected.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    assert composed_epsilon(runs, DELTA, accountant) == pytest.approx(
        expected.get_epsilon(DELTA), rel=1e-9)
    assert sum(n for _, _, n in compose_histories(runs)) == 950


def test_trials_survive_their_json_form():
    for trials in (poisson_trials(4.0), truncated_negative_binomial_trials(0.5, 0.2)):
        assert Trials.from_json(trials.to_json()) == trials


@pytest.mark.parametrize("make", [lambda: poisson_trials(0.5), lambda: poisson_trials(math.inf),
                                  lambda: truncated_negative_binomial_trials(-1, 0.5),
                                  lambda: truncated_negative_binomial_trials(1, 1.0),
                                  lambda: Trials.from_json({"distribution": "uniform"})])
def test_invalid_trial_distributions_are_refused_with_a_privacy_error(make):
    with pytest.raises(PrivacyError):
        make()


# ------------------------------------------------------------------ runs charged differently
def test_one_balls_in_bins_run_composed_alone_costs_its_own_random_allocation_epsilon():
    """The issue's scale point (sigma 1, 10 steps an epoch, 3 epochs, delta 1e-4: 3.276), where
    the remove direction decides: composing it alone adds nothing."""
    from dptrain.accounting import random_allocation
    from dptrain.accounting.selections import selection_accounting

    bins = selection_accounting("balls_in_bins")
    alone = composed_rdp_epsilon([[(1.0, 0.1, 30)]], [bins], 1e-4)
    assert alone == pytest.approx(random_allocation.epsilon(1.0, 10, 3, 1e-4), rel=1e-12)
    assert composed_rdp_epsilon([[(1.0, 0.1, 30)]] * 2, [bins] * 2, 1e-4) > alone


def test_poisson_runs_composed_by_curves_alone_give_the_rdp_accountants_epsilon():
    """Alone, Poisson's curves keep every order of the RDP accountant (mixed with random
    allocation only its integer orders are shared)."""
    from dptrain.accounting.selections import selection_accounting

    poisson = selection_accounting("poisson")
    runs = [[(1.0, 0.01, 300)], [(2.0, 0.01, 300)]]
    assert composed_rdp_epsilon(runs, [poisson] * 2, DELTA) == pytest.approx(
        composed_epsilon(runs, DELTA, "rdp"), rel=1e-12)


def test_a_run_whose_charge_does_not_compose_is_refused_with_the_reason():
    from dptrain.accounting.selections import selection_accounting

    with pytest.raises(PrivacyError, match="substitution"):
        composed_rdp_epsilon([[(1.0, 0.1, 30)]], [selection_accounting("shuffle")], DELTA)
    with pytest.raises(PrivacyError, match="one per history"):
        composed_rdp_epsilon([[(1.0, 0.1, 30)]] * 2, [selection_accounting("poisson")], DELTA)
