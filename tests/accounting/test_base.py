"""Behaviour shared by every accountant: history, validation, state, registry."""

import math
import warnings

import pytest

from dptrain.accounting import ACCOUNTANTS, compute_epsilon, get_accountant
from dptrain.errors import PrivacyError

NAMES = sorted(ACCOUNTANTS)


@pytest.fixture(autouse=True)
def _quiet_gdp_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="gdp accountant")
        yield


@pytest.mark.parametrize("name", NAMES)
def test_get_accountant_returns_the_registered_class_with_its_name(name):
    acc = get_accountant(name)
    assert isinstance(acc, ACCOUNTANTS[name]) and acc.name == name


def test_unknown_accountant_name_raises_privacy_error_listing_choices():
    with pytest.raises(PrivacyError, match="accountant='moments'.*'gdp', 'prv', 'rdp'"):
        get_accountant("moments")


@pytest.mark.parametrize("name", NAMES)
def test_consecutive_identical_steps_merge_into_one_run(name):
    acc = get_accountant(name)
    for _ in range(3):
        acc.step(noise_multiplier=1.0, sample_rate=0.01)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=7)
    acc.step(noise_multiplier=2.0, sample_rate=0.01, steps=5)
    assert acc.history == [(1.0, 0.01, 10), (2.0, 0.01, 5)]
    assert len(acc) == 15


@pytest.mark.parametrize("kwargs, argument", [
    (dict(noise_multiplier=-0.1, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=math.nan, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
    (dict(noise_multiplier=1.0, sample_rate=-0.01), "sample_rate"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, steps=-1), "steps"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, steps=1.5), "steps"),
])
def test_step_rejects_invalid_arguments_naming_them(kwargs, argument):
    acc = get_accountant("rdp")
    with pytest.raises(PrivacyError, match=argument):
        acc.step(**kwargs)
    assert acc.history == []


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_get_epsilon_rejects_delta_outside_open_unit_interval(name, delta):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(PrivacyError, match="delta"):
        acc.get_epsilon(delta)


@pytest.mark.parametrize("name", NAMES)
def test_zero_noise_gives_infinite_epsilon_with_a_warning(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=10)
    with pytest.warns(UserWarning, match="infinite"):
        acc.step(noise_multiplier=0.0, sample_rate=0.01)
    with pytest.warns(UserWarning, match="infinite"):
        assert acc.get_epsilon(1e-5) == math.inf
    with pytest.warns(UserWarning, match="infinite"):
        assert acc.get_delta(5.0) == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_zero_sample_rate_steps_are_counted_but_spend_nothing(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.02, steps=50)
    before = acc.get_epsilon(1e-5)
    acc.step(noise_multiplier=0.0, sample_rate=0.0, steps=1000)
    assert len(acc) == 1050
    assert acc.get_epsilon(1e-5) == before


@pytest.mark.parametrize("name", NAMES)
def test_empty_history_has_zero_epsilon(name):
    assert get_accountant(name).get_epsilon(1e-5) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_restores_history_and_epsilon(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.1, sample_rate=0.01, steps=100)
    acc.step(noise_multiplier=0.9, sample_rate=0.02, steps=20)
    other = get_accountant(name)
    other.load_state_dict(acc.state_dict())
    assert other.history == acc.history
    assert other.get_epsilon(1e-5) == acc.get_epsilon(1e-5)


def test_load_state_dict_of_another_accountant_raises():
    acc = get_accountant("rdp")
    with pytest.raises(PrivacyError, match="'prv'"):
        acc.load_state_dict(get_accountant("prv").state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_compute_epsilon_equals_accountant_epsilon_and_accepts_mappings(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=300)
    acc.step(noise_multiplier=1.5, sample_rate=0.05, steps=30)
    as_dicts = [{"noise_multiplier": s, "sample_rate": q, "steps": n} for s, q, n in acc.history]
    assert compute_epsilon(acc.history, 1e-5, accountant=name) == acc.get_epsilon(1e-5)
    assert compute_epsilon(as_dicts, 1e-5, accountant=name) == acc.get_epsilon(1e-5)


def test_compute_epsilon_rejects_a_malformed_history_naming_the_run():
    with pytest.raises(PrivacyError, match=r"history\[1\].sample_rate"):
        compute_epsilon([(1.0, 0.1, 3), (1.0, 7.0, 3)], 1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_get_delta_is_consistent_with_get_epsilon(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.02, steps=200)
    eps = acc.get_epsilon(1e-5)
    assert acc.get_delta(eps * 1.02) <= 1e-5 * 1.0001
    assert acc.get_delta(eps * 0.9) > 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_epsilon_grows_with_steps_and_sample_rate_and_falls_with_sigma(name):
    def eps(sigma, q, steps):
        return compute_epsilon([(sigma, q, steps)], 1e-5, accountant=name)

    base = eps(1.0, 0.01, 500)
    assert eps(1.0, 0.01, 1000) > base
    assert eps(1.0, 0.02, 500) > base
    assert eps(1.5, 0.01, 500) < base


def test_stepping_a_schedule_of_distinct_sigmas_keeps_one_run_per_step():
    # how long stepping takes is measured by scripts/benchmark_accounting.py, not by a timed test
    acc = get_accountant("rdp")
    for i in range(50_000):
        acc.step(noise_multiplier=1.0 + 1e-6 * i, sample_rate=0.01)
    assert len(acc) == 50_000 and len(acc.history) == 50_000


def test_coarsened_history_dominates_with_fewer_pairs_and_the_same_steps():
    from dptrain.accounting.history import coarsen_history

    runs = [(1.0 + 0.0007 * i, 0.01 + 1e-5 * i, 3) for i in range(500)]
    coarse = coarsen_history(runs, 32)
    assert len(coarse) <= 32 and sum(n for _, _, n in coarse) == 1500
    sigmas, rates = [s for s, _, _ in coarse], [q for _, q, _ in coarse]
    assert min(sigmas) <= 1.0 and max(sigmas) <= runs[-1][0]
    assert min(rates) >= 0.01 and max(rates) >= runs[-1][1]


def test_rdp_of_a_long_noise_schedule_is_an_upper_bound_close_to_exact():
    from dptrain.accounting import RDPAccountant
    from dptrain.accounting.rdp import rdp_of_history, rdp_to_epsilon

    orders = [float(a) for a in range(2, 33)]
    runs = [(1.0 + 0.002 * i, 0.01, 10) for i in range(200)]
    exact = rdp_to_epsilon(rdp_of_history(runs, orders), orders, 1e-5)[0]
    acc = RDPAccountant(orders=orders)
    for sigma, q, n in runs:
        acc.step(noise_multiplier=sigma, sample_rate=q, steps=n)
    assert exact <= acc.get_epsilon(1e-5) <= exact * 1.01


def test_steps_given_as_a_numpy_integer_are_accepted():
    import numpy as np

    acc = get_accountant("rdp")
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=np.int64(20))
    assert len(acc) == 20 and isinstance(acc.history[0][2], int)


@pytest.mark.parametrize("steps", [math.inf, math.nan])
def test_non_finite_steps_raise_privacy_error_naming_steps(steps):
    with pytest.raises(PrivacyError, match="steps="):
        get_accountant("rdp").step(noise_multiplier=1.0, sample_rate=0.01, steps=steps)


def test_coarsening_a_noise_schedule_keeps_its_constant_sample_rate_and_its_own_sigmas():
    from dptrain.accounting.history import coarsen_history

    runs = [(1.5 - 0.0007 * i, 0.01, 2) for i in range(1000)]    # sigma 1.5 .. 0.8007
    coarse = coarsen_history(runs, 32)
    assert len(coarse) <= 32 and sum(n for _, _, n in coarse) == 2000
    assert {q for _, q, _ in coarse} == {0.01}
    assert {s for s, _, _ in coarse} <= {s for s, _, _ in runs}
    assert min(s for s, _, _ in coarse) == runs[-1][0]


def test_a_coarsened_schedule_of_sigma_and_q_has_at_least_the_rdp_of_the_exact_one():
    import numpy as np

    from dptrain.accounting.history import coarsen_history
    from dptrain.accounting.rdp import rdp_of_history

    runs = [(0.8 + 0.01 * (i % 70), 0.001 + 0.0001 * (i % 13), 1) for i in range(910)]
    coarse = coarsen_history(runs, 32)
    assert len(coarse) <= 32 and sum(n for _, _, n in coarse) == 910
    orders = [2.0, 8.0, 32.0]
    exact, bound = rdp_of_history(runs, orders), rdp_of_history(coarse, orders)
    assert np.all(bound >= exact)


def test_coarsening_a_sigma_only_schedule_costs_little_epsilon():
    from dptrain.accounting.history import coarsen_history
    from dptrain.accounting.rdp import rdp_of_history, rdp_to_epsilon

    orders = [float(a) for a in range(2, 33)]
    runs = [(1.5 - 0.0025 * i, 0.01, 30) for i in range(280)]       # sigma 1.5 -> 0.8025

    def epsilon(history):
        return rdp_to_epsilon(rdp_of_history(history, orders), orders, 1e-5)[0]

    assert epsilon(runs) <= epsilon(coarsen_history(runs, 32)) <= 1.03 * epsilon(runs)


def test_prv_state_dict_round_trip_keeps_the_requested_error():
    from dptrain.accounting import PRVAccountant

    acc = PRVAccountant(eps_error=0.05)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=10)
    other = PRVAccountant()
    other.load_state_dict(acc.state_dict())
    assert other.eps_error == 0.05 and other.history == acc.history


def test_rdp_state_dict_with_an_unknown_conversion_is_refused_and_changes_nothing():
    acc = get_accountant("rdp")
    state = acc.state_dict()
    state["conversion"] = "loose"
    state["history"] = [[1.0, 0.01, 10]]
    with pytest.raises(PrivacyError, match="conversion"):
        acc.load_state_dict(state)
    assert acc.history == [] and acc.conversion == "tight"


@pytest.mark.parametrize("name", NAMES)
def test_a_shuffled_history_is_refused_by_a_poisson_accountant_of_its_name_and_the_reverse(name):
    """A shuffled accountant carries the configured name: only the recorded charge tells its
    history (no amplification, epochs) from a Poisson one (amplified)."""
    shuffled = get_accountant(name, "shuffle")
    shuffled.step(noise_multiplier=1.0, sample_rate=0.25, steps=4)
    poisson = get_accountant(name)
    with pytest.raises(PrivacyError, match="charged as selection=shuffle.*selection=poisson"):
        poisson.load_state_dict(shuffled.state_dict())
    assert len(poisson) == 0
    poisson.step(noise_multiplier=1.0, sample_rate=0.25, steps=4)
    with pytest.raises(PrivacyError, match="charged as selection=poisson.*selection=shuffle"):
        get_accountant(name, "shuffle").load_state_dict(poisson.state_dict())


def test_a_cyclic_poisson_history_is_refused_by_a_plain_poisson_accountant():
    from dptrain.accounting.events import AccountingEvent

    cyclic = get_accountant("prv", AccountingEvent("cyclic_poisson", groups=4))
    cyclic.step(noise_multiplier=1.0, sample_rate=0.1, steps=4)
    with pytest.raises(PrivacyError, match="groups=4"):
        get_accountant("prv").load_state_dict(cyclic.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_a_state_saved_before_the_charge_was_recorded_loads_as_before(name):
    acc = get_accountant(name)
    acc.step(noise_multiplier=1.0, sample_rate=0.25, steps=4)
    old = {key: value for key, value in acc.state_dict().items() if key != "charges"}
    for sampling in ("poisson", "shuffle"):
        other = get_accountant(name, sampling)
        other.load_state_dict(old)
        assert other.history == acc.history


def test_a_state_whose_charge_is_not_a_mapping_is_refused_naming_it():
    acc = get_accountant("rdp")
    with pytest.raises(PrivacyError, match="charged as 'shuffle'"):
        acc.load_state_dict({"name": "rdp", "history": [], "charges": "shuffle"})
