"""Correlated noise: the sensitivity of a Toeplitz strategy and the epsilon of its events."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from dptrain.accounting import compute_epsilon, get_accountant
from dptrain.accounting.events import AccountingEvent, CorrelatedNoiseAccountant
from dptrain.accounting.gdp import gdp_epsilon
from dptrain.accounting.matrix_factorization import (
    Participation,
    amplified_history,
    sensitivity,
    shuffle_participation,
    unamplified_mu,
)
from dptrain.accounting.rdp import RDPAccountant
from dptrain.accounting.shuffle import shuffle_epsilon, shuffle_mu
from dptrain.errors import PrivacyError


@dataclass(frozen=True)
class Column:
    """A test strategy: a fixed head of a column (zeros after it), or a BLT column
    c_0 = 1, c_k = sum_i omega_i theta_i^(k - 1)."""

    head: tuple[float, ...] = ()
    omega: tuple[float, ...] = ()
    theta: tuple[float, ...] = ()

    def toeplitz_column(self, num_steps: int) -> np.ndarray:
        if self.omega:
            k = np.arange(1, num_steps, dtype=np.float64)
            tail = sum(w * t ** (k - 1) for w, t in zip(self.omega, self.theta))
            return np.concatenate([[1.0], tail])[:num_steps]
        out = np.zeros(num_steps)
        n = min(num_steps, len(self.head))
        out[:n] = self.head[:n]
        return out

    def to_dict(self) -> dict:
        return {"head": list(self.head), "omega": list(self.omega), "theta": list(self.theta)}


def banded(*entries: float) -> Column:
    """A banded column normalised to norm 1."""
    c = np.asarray(entries, dtype=np.float64)
    return Column(head=tuple(c / np.linalg.norm(c)))


def blt(omega: tuple[float, ...], theta: tuple[float, ...]) -> Column:
    return Column(omega=omega, theta=theta)


# ---------------------------------------------------------------------------------- oracle
def patterns(participation: Participation, steps: int):
    """Every participation pattern of the schema on `steps` steps (non-empty index tuples)."""
    k, m = participation.separation, participation.max_participations
    if participation.kind == "min_separation":
        for size in range(1, m + 1):
            for pattern in itertools.combinations(range(steps), size):
                if all(b - a >= k for a, b in zip(pattern, pattern[1:])):
                    yield pattern
        return
    blocks = [list(range(e * k, min((e + 1) * k, steps))) + [None]
              for e in range(min(m, math.ceil(steps / k)))]
    for choice in itertools.product(*blocks):
        pattern = tuple(i for i in choice if i is not None)
        if pattern:
            yield pattern


def brute_force_sensitivity(column: np.ndarray, participation: Participation) -> float:
    """max over patterns and signs of ||C u||, C the lower-triangular Toeplitz of `column`."""
    steps = column.size
    matrix = np.array([[column[i - j] if i >= j else 0.0 for j in range(steps)]
                       for i in range(steps)])
    best = 0.0
    for pattern in patterns(participation, steps):
        for signs in itertools.product((1.0, -1.0), repeat=len(pattern) - 1):
            u = np.zeros(steps)
            u[list(pattern)] = (1.0, *signs)
            best = max(best, float(np.linalg.norm(matrix @ u)))
    return best


# ---------------------------------------------------------------------------------- sensitivity
@pytest.mark.parametrize("column, steps, k, m", [
    (banded(1.0, -0.6, 0.3), 9, 3, 3),
    (banded(1.0, 0.7), 8, 2, 4),
    (banded(1.0, 0.7), 8, 3, 2),
    (banded(1.0, -0.2, 0.5, 0.1), 10, 4, 3),
])
def test_sensitivity_of_a_banded_column_with_participations_its_bands_apart_equals_brute_force(
        column, steps, k, m):
    c = column.toeplitz_column(steps)
    schema = Participation("min_separation", k, m)
    assert sensitivity(c, schema) == pytest.approx(brute_force_sensitivity(c, schema), rel=1e-12)


@pytest.mark.parametrize("column, steps, k, m", [
    (blt((0.4,), (0.7,)), 9, 2, 4),
    (blt((0.3, 0.2), (0.9, 0.5)), 10, 3, 3),
    (banded(1.0, 0.8, 0.5, 0.2), 9, 2, 5),
    (blt((0.5,), (0.95,)), 8, 1, 8),
])
def test_sensitivity_of_a_decreasing_nonnegative_column_equals_brute_force(column, steps, k, m):
    c = column.toeplitz_column(steps)
    schema = Participation("min_separation", k, m)
    assert sensitivity(c, schema) == pytest.approx(brute_force_sensitivity(c, schema), rel=1e-12)


@pytest.mark.parametrize("column, steps, k", [
    (blt((0.4,), (0.7,)), 9, 3),
    (banded(1.0, 0.5), 8, 4),
    (banded(1.0, -0.5, 0.25), 9, 3),
    (blt((0.3, 0.2), (0.9, 0.5)), 8, 2),
])
def test_one_per_block_sensitivity_is_an_upper_bound_within_15_percent_of_brute_force(column,
                                                                                     steps, k):
    c = column.toeplitz_column(steps)
    schema = Participation("one_per_block", k, math.ceil(steps / k))
    exact = brute_force_sensitivity(c, schema)
    assert exact <= sensitivity(c, schema) * (1 + 1e-12)
    assert sensitivity(c, schema) <= 1.15 * exact


def test_one_per_block_sensitivity_of_the_identity_is_the_root_of_the_number_of_epochs():
    c = np.eye(1, 30).ravel()
    assert sensitivity(c, Participation("one_per_block", 6, 5)) == pytest.approx(math.sqrt(5))


def test_a_column_with_more_bands_than_the_separation_and_no_known_bound_is_refused():
    with pytest.raises(PrivacyError, match="no sensitivity bound"):
        sensitivity(np.array([1.0, -0.5, 0.3, 0.1]), Participation("min_separation", 2, 2))


# ---------------------------------------------------------------------------------- events
def test_one_group_and_the_identity_column_charge_exactly_dp_sgd():
    history = [(1.1, 0.01, 300), (0.9, 0.02, 50), (1.1, 0.01, 7)]   # schedules included
    event = AccountingEvent("cyclic_poisson", 1, banded(1.0))
    for name in ("prv", "rdp"):
        ours = get_accountant(name, event)
        assert isinstance(ours, CorrelatedNoiseAccountant)
        ours.load_state_dict({"name": name, "history": history})
        assert ours.get_epsilon(1e-5) == compute_epsilon(history, 1e-5, name)
    assert amplified_history(history, 1, [1.0]) == history


def test_the_identity_column_unamplified_is_exactly_the_shuffle_accounting():
    history = [(1.3, 0.1, 35)]
    identity = np.eye(1, 35).ravel()
    mu = unamplified_mu(history, identity, shuffle_participation(history), 2.0)
    assert mu == shuffle_mu(history)
    assert gdp_epsilon(mu, 1e-6) == shuffle_epsilon(history, 1e-6)


def test_a_shuffled_run_with_correlated_noise_is_charged_its_one_per_epoch_sensitivity():
    history = [(2.0, 0.25, 12)]
    column = blt((0.4,), (0.7,))
    sens = sensitivity(column.toeplitz_column(12), Participation("one_per_block", 4, 3))
    epsilon = compute_epsilon(history, 1e-5, "prv", AccountingEvent("shuffle", 1, column))
    assert sens > math.sqrt(3)
    assert epsilon == gdp_epsilon(2.0 * sens / 2.0, 1e-5)


def test_steps_that_sample_nobody_keep_the_positions_of_the_cyclic_groups():
    # group 0 takes part at steps 0 and 2: two rounds, although step 1 sampled nobody
    history = [(1.0, 0.1, 1), (1.0, 0.0, 1), (1.0, 0.1, 1)]
    event = AccountingEvent("cyclic_poisson", 2, banded(1.0, 0.5))
    two_rounds = compute_epsilon([(1.0, 0.2, 2)], 1e-5, "rdp")
    assert compute_epsilon(history, 1e-5, "rdp", event) == pytest.approx(two_rounds, rel=1e-12)


def test_a_smaller_sigma_anywhere_in_a_round_lowers_that_rounds_sigma():
    rounds = amplified_history([(2.0, 0.1, 3), (1.0, 0.1, 1), (2.0, 0.1, 4)], 4, [1.0, 0.0])
    assert rounds == [(1.0, 0.4, 1), (2.0, 0.4, 1)]
    banded_rounds = amplified_history([(2.0, 0.1, 4), (1.0, 0.1, 1), (2.0, 0.1, 3)], 4,
                                      [0.8, 0.6])
    # steps 0-3 (round 0) touch rows up to step 4, whose sigma is 1: both rounds at sigma 1
    assert banded_rounds == [(pytest.approx(1.0), 0.4, 2)]


def test_a_strategy_with_more_bands_than_groups_is_charged_without_amplification():
    history = [(3.0, 0.05, 40)]
    column = banded(1.0, 0.5, 0.25)
    event = AccountingEvent("cyclic_poisson", 2, column)
    sens = sensitivity(column.toeplitz_column(40), Participation("min_separation", 2, 20))
    assert not event.amplified(40)
    assert compute_epsilon(history, 1e-5, "prv", event) == gdp_epsilon(sens / 3.0, 1e-5)


def test_the_event_is_equal_and_hashed_by_its_strategys_recorded_dict():
    a = AccountingEvent("cyclic_poisson", 2, banded(1.0, 0.5))
    b = AccountingEvent("cyclic_poisson", 2, banded(1.0, 0.5))
    assert a == b and hash(a) == hash(b)
    assert a != AccountingEvent("cyclic_poisson", 2, banded(1.0, 0.4))


# ---------------------------------------------------------------------------------- jax_privacy
GRID = [(b, sigma, q_group, steps) for b in (1, 2, 8)
        for sigma, q_group, steps in [(1.0, 0.05, 400), (2.5, 0.2, 1000), (1.5, 0.5, 256)]]
INTEGER_ORDERS = [float(a) for a in range(2, 65)]


@pytest.fixture(scope="module")
def jax_privacy_accounting():
    return pytest.importorskip("jax_privacy.experimental.accounting",
                               reason="jax_privacy does not import here")


@pytest.mark.parametrize("b, sigma, q_group, steps", GRID)
def test_amplified_epsilon_matches_jax_privacys_bandmf_event_within_one_percent(
        jax_privacy_accounting, b, sigma, q_group, steps):
    dp_accounting = pytest.importorskip("dp_accounting")
    event = jax_privacy_accounting.amplified_bandmf_event(sigma, steps, num_bands=b,
                                                          sampling_prob=q_group)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3).compose(event)
    ours = AccountingEvent("cyclic_poisson", b, banded(*np.linspace(1.0, 0.2, b)))
    history = [(sigma, q_group / b, steps)]   # q: each example's overall share of a batch
    assert compute_epsilon(history, 1e-6, "prv", ours) == pytest.approx(
        pld.get_epsilon(1e-6), rel=0.01)
    # RDP: the same rounds at the same orders (dp_accounting drops fractional orders whose
    # series it cannot sum, so with the default orders ours is the tighter of the two)
    theirs = dp_accounting.rdp.RdpAccountant(orders=INTEGER_ORDERS).compose(event)
    rounds = amplified_history(history, b, ours.column(steps))
    rdp = RDPAccountant(orders=INTEGER_ORDERS)
    rdp.load_state_dict({"name": "rdp", "history": rounds, "orders": INTEGER_ORDERS})
    assert rdp.get_epsilon(1e-6) == pytest.approx(theirs.get_epsilon(1e-6), rel=0.01)
    default = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-6)
    assert compute_epsilon(history, 1e-6, "rdp", ours) <= default * (1 + 1e-9)
