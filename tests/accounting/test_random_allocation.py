"""Random allocation (balls in bins) accounting: an upper bound, checked against the
`random-allocation` package and against numerical integration of the divergences themselves.

The reference values in data/random_allocation_reference.json were produced by
`random-allocation` 1.0.5 (Feldman and Shenfeld; with dp-accounting 0.6.0, numpy 2.1.3) through
scripts/random_allocation_reference.py, in its own environment (the package pins numpy < 2.2,
so it cannot be a dependency).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import special

from dptrain.accounting import random_allocation as ra
from dptrain.accounting.rdp import rdp_sampled_gaussian, rdp_to_epsilon
from dptrain.errors import PrivacyError

REFERENCE = json.loads((Path(__file__).parent / "data/random_allocation_reference.json").read_text())
POINTS = REFERENCE["points"]


def _point_id(p: dict) -> str:
    return f"s{p['sigma']}-k{p['steps_per_epoch']}-E{p['epochs']}-d{p['delta']:g}"


def test_reference_fixture_covers_at_least_twelve_points_from_the_named_package() -> None:
    assert REFERENCE["package"] == "random-allocation" and REFERENCE["version"] == "1.0.5"
    assert len({_point_id(p) for p in POINTS}) >= 12


@pytest.mark.parametrize("p", POINTS, ids=_point_id)
def test_epsilon_is_within_five_percent_above_the_packages_tightest_bound_and_above_its_lower_bound(p: dict) -> None:
    ours = ra.epsilon(p["sigma"], p["steps_per_epoch"], p["epochs"], p["delta"])
    assert ours <= 1.05 * p["combined"]
    if p["lower"] is not None:
        assert ours >= p["lower"]


@pytest.mark.parametrize("p", POINTS, ids=_point_id)
def test_remove_direction_is_the_packages_exact_remove_analysis_at_its_orders(p: dict) -> None:
    """Where ours is below the package's tightest bound, this is why: our remove direction is
    the same exact RDP (Feldman-Shenfeld) - equal at the package's orders 2..60 - optimised over
    more orders, and our add direction is the exact divergence (integrated) where the package
    uses looser add-direction bounds; ours is never below its remove analysis at those orders
    by more than the extra orders give."""
    orders = list(range(2, 61))
    curve = ra.rdp_remove(p["sigma"], p["steps_per_epoch"], p["epochs"], orders)
    at_package_orders = rdp_to_epsilon(curve, orders, p["delta"])[0]
    assert at_package_orders == pytest.approx(p["direct_remove"], rel=1e-9)
    assert ra.epsilon(p["sigma"], p["steps_per_epoch"], p["epochs"], p["delta"]) <= at_package_orders


def test_issue_scale_point_is_below_the_packages_rdp_figure_and_equals_its_direct_analysis() -> None:
    p = next(q for q in POINTS if (q["sigma"], q["steps_per_epoch"], q["epochs"], q["delta"]) == (1.0, 10, 3, 1e-4))
    ours = ra.epsilon(1.0, 10, 3, 1e-4)
    assert p["rdp_dco"] == pytest.approx(3.80, abs=0.005)
    assert ours < p["rdp_dco"]
    assert ours == pytest.approx(p["direct"], rel=1e-9)


def _hermite_grid(k: int, sigma: float, nodes: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """Points x [nodes^k, k] and weights [nodes^k] integrating against N(0, sigma^2 I_k)."""
    t, w = np.polynomial.hermite.hermgauss(nodes)
    xs = np.array(list(itertools.product(t, repeat=k))) * sigma * math.sqrt(2)
    ws = np.prod(np.array(list(itertools.product(w, repeat=k))), axis=1) / math.pi ** (k / 2)
    return xs, ws


def _log_likelihood_ratio(x: np.ndarray, sigma: float) -> np.ndarray:
    """log dP/dQ [n] at points x [n, k]: P = (1/k) sum_j N(e_j, s^2 I), Q = N(0, s^2 I)."""
    k = x.shape[1]
    return special.logsumexp((x - 0.5) / sigma**2, axis=1) - math.log(k)


@pytest.mark.parametrize("k,sigma", [(2, 1.0), (3, 1.5), (2, 2.0)])
def test_remove_curve_equals_the_divergence_integrated_numerically(k: int, sigma: float) -> None:
    x, w = _hermite_grid(k, sigma)
    log_l = _log_likelihood_ratio(x, sigma)
    orders = np.arange(2, 7)
    exact = [math.log(np.sum(w * np.exp(a * log_l))) / (a - 1) for a in orders]
    np.testing.assert_allclose(ra.rdp_remove(sigma, k, 1, orders), exact, rtol=1e-6)


@pytest.mark.parametrize("k,sigma", [(2, 1.0), (3, 1.5), (2, 0.7), (3, 3.0)])
def test_add_curve_equals_the_divergence_integrated_over_the_k_steps_and_lies_below_the_am_gm_bound(k: int, sigma: float) -> None:
    """The add direction's 1-D integral representation against direct k-dimensional
    Gauss-Hermite quadrature, and against the closed-form upper bound of AM-GM,
    D_a(Q||P) <= 1 / (2 sigma^2) + (a - 1) / (2 k sigma^2)."""
    x, w = _hermite_grid(k, sigma)
    log_l = _log_likelihood_ratio(x, sigma)
    orders = np.arange(2, 9)
    exact = np.array([math.log(np.sum(w * np.exp(-(a - 1) * log_l))) / (a - 1) for a in orders])
    ours = ra.rdp_add(sigma, k, 1, orders)
    np.testing.assert_allclose(ours, exact, rtol=1e-6)
    assert np.all(ours <= 1 / (2 * sigma**2) + (orders - 1) / (2 * k * sigma**2))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_one_step_per_epoch_is_the_gaussian_mechanism_without_amplification(sigma: float) -> None:
    orders = ra.DEFAULT_ORDERS
    gaussian = rdp_sampled_gaussian(1.0, sigma, [float(a) for a in orders])
    np.testing.assert_allclose(ra.rdp_remove(sigma, 1, 1), gaussian, rtol=1e-12)
    np.testing.assert_allclose(ra.rdp_add(sigma, 1, 1), gaussian[: len(ra.ADD_ORDERS)], rtol=1e-12)
    expected = rdp_to_epsilon(3 * gaussian, orders, 1e-5)[0]
    assert ra.epsilon(sigma, 1, 3, 1e-5) == pytest.approx(expected, rel=1e-12)


def test_epsilon_decreases_with_sigma_and_with_steps_per_epoch_and_grows_with_epochs() -> None:
    by_sigma = [ra.epsilon(s, 10, 3, 1e-5) for s in (0.6, 0.8, 1.0, 1.5, 2.0, 4.0)]
    by_steps = [ra.epsilon(1.0, k, 3, 1e-5) for k in (1, 2, 5, 10, 50, 200)]
    by_epochs = [ra.epsilon(1.0, 10, e, 1e-5) for e in (1, 2, 5, 20)]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:]))
    assert all(a > b for a, b in zip(by_steps, by_steps[1:]))
    assert all(a < b for a, b in zip(by_epochs, by_epochs[1:]))


def test_epochs_compose_by_adding_the_per_epoch_curves() -> None:
    np.testing.assert_allclose(ra.rdp(1.3, 20, 7), 7 * ra.rdp(1.3, 20, 1), rtol=1e-12)
    assert ra.epsilon(1.3, 20, 0, 1e-5) == 0.0


def test_rdp_is_the_larger_direction_at_each_order() -> None:
    both = ra.rdp(1.0, 10, 2)
    remove, add = ra.rdp_remove(1.0, 10, 2, ra.ADD_ORDERS), ra.rdp_add(1.0, 10, 2)
    np.testing.assert_array_equal(both, np.maximum(remove, add))


@pytest.mark.parametrize("kwargs,key", [
    (dict(sigma=-1.0, steps_per_epoch=10, epochs=1, delta=1e-5), "sigma"),
    (dict(sigma=1.0, steps_per_epoch=0, epochs=1, delta=1e-5), "steps_per_epoch"),
    (dict(sigma=1.0, steps_per_epoch=2.5, epochs=1, delta=1e-5), "steps_per_epoch"),
    (dict(sigma=1.0, steps_per_epoch=10, epochs=-1, delta=1e-5), "epochs"),
    (dict(sigma=1.0, steps_per_epoch=10, epochs=1, delta=1.5), "delta"),
])
def test_bad_input_is_refused_naming_the_argument(kwargs: dict, key: str) -> None:
    with pytest.raises(PrivacyError, match=key):
        ra.epsilon(**kwargs)


def test_fractional_or_too_high_orders_are_refused() -> None:
    with pytest.raises(PrivacyError, match="orders"):
        ra.rdp_remove(1.0, 10, 1, [1.5, 2])
    with pytest.raises(PrivacyError, match="orders"):
        ra.rdp_add(1.0, 10, 1, [2, ra.ADD_MAX_ORDER + 1])


def test_zero_noise_spends_everything() -> None:
    assert ra.epsilon(0.0, 10, 1, 1e-5) == math.inf


@pytest.mark.parametrize("p", POINTS[::3], ids=_point_id)
def test_closed_form_add_bound_lies_above_the_integrated_add_direction(p: dict) -> None:
    args = (p["sigma"], p["steps_per_epoch"], p["epochs"])
    integrated = rdp_to_epsilon(ra.rdp_add(*args), ra.ADD_ORDERS, p["delta"])[0]
    assert ra.add_epsilon_closed_form(*args, p["delta"]) >= integrated


def test_issue_scale_point_is_decided_by_closed_forms_without_quadrature() -> None:
    ra._add_curve.cache_clear()
    remove, add = ra.epsilon_by_direction(1.0, 10, 3, 1e-4)
    assert ra._add_curve.cache_info().currsize == 0
    assert add <= remove == ra.epsilon(1.0, 10, 3, 1e-4)
