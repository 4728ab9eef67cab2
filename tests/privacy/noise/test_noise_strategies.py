"""Noise strategies: their columns, their recorded form, their optimised losses (against DP-SGD
and JAX Privacy's optimisers) and the rules they impose on the plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt, Independent, strategy_for, strategy_from_dict
from dptrain.privacy.noise import toeplitz
from dptrain.privacy.noise.banded import sqrt_prefix_coefficients
from dptrain.privacy.noise.blt import blt_loss
from dptrain.accounting import get_noise_multiplier
from dptrain.privacy.plan import Clipping, Noise, PrivacyPlan, Selection, calibrated, selection_for


def _plan(strategy, **noise):
    """A plan with `strategy` and the batch selection it picks (q = 0.1)."""
    noise = Noise(multiplier=1.0, strategy=strategy, **noise)
    return PrivacyPlan(selection=selection_for(noise, 0.1), clipping=Clipping(1.0), noise=noise,
                       delta=1e-5)


# -- columns and recorded form -----------------------------------------------------------------
def test_the_independent_column_is_the_identitys():
    assert Independent().toeplitz_column(4).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_banded_column_is_normalised_and_zero_past_its_bands():
    column = Banded((2.0, 1.0)).toeplitz_column(4)
    assert np.allclose(column, [2 / 5 ** 0.5, 1 / 5 ** 0.5, 0.0, 0.0])


def test_a_blt_column_is_one_then_a_sum_of_geometric_sequences():
    column = Blt((0.5, 0.25), (0.2, 0.4)).toeplitz_column(4)
    assert np.allclose(column, [1.0, 0.6, 0.2 * 0.5 + 0.4 * 0.25, 0.2 * 0.25 + 0.4 * 0.0625])


@pytest.mark.parametrize("strategy", [Independent(), Banded((1.0, 0.5)), Blt((0.9,), (0.3,))],
                         ids=lambda s: s.name)
def test_the_plan_records_the_strategy_and_reads_it_back_from_json(strategy):
    plan = _plan(strategy)
    recorded = json.loads(json.dumps(plan.to_dict()))
    assert recorded["noise"]["strategy"]["name"] == strategy.name
    back = PrivacyPlan.from_dict(recorded)
    assert back.noise.strategy == strategy and back.differences(plan) == []


def test_a_plan_recorded_before_noise_strategies_reads_back_as_independent_noise():
    recorded = _plan(Independent()).to_dict()
    del recorded["noise"]["strategy"]
    back = PrivacyPlan.from_dict(recorded)
    assert back.noise.strategy == Independent() and back.differences(_plan(Independent())) == []


def test_two_plans_with_other_band_coefficients_differ():
    assert _plan(Banded((1.0, 0.5))).differences(_plan(Banded((1.0, 0.4))))


def test_an_unknown_recorded_strategy_is_refused_by_name():
    with pytest.raises(ConfigError, match="'spiky'"):
        strategy_from_dict({"name": "spiky"})


@pytest.mark.parametrize("bad", [((0.5,), (1.2,)), ((1.0,), (0.2,)), ((0.5, 0.4), (0.2,))])
def test_blt_parameters_outside_a_positive_decreasing_column_are_refused(bad):
    with pytest.raises(ConfigError, match="blt"):
        Blt(*bad)


# -- rules on the plan ---------------------------------------------------------------------
@pytest.mark.parametrize("noise,selection,clipping", [
    ({"schedule": {"kind": "exponential", "gamma": 0.99}}, {}, {}),
    ({}, {"schedule": {"kind": "exponential", "gamma": 0.99}}, {}),
    ({}, {}, {"kind": "adaptive"}),
])
def test_correlated_noise_refuses_what_changes_its_std_from_step_to_step(noise, selection,
                                                                           clipping):
    with pytest.raises(ConfigError, match="constant std"):
        PrivacyPlan(selection=Selection(sample_rate=0.1, **selection),
                    clipping=Clipping(1.0, **clipping),
                    noise=Noise(multiplier=1.0, strategy=Banded((1.0, 0.5)), **noise))


@pytest.mark.parametrize("strategy", [Banded((1.0, 0.5)), Blt((0.9,), (0.3,))],
                         ids=lambda s: s.name)
def test_sigma_for_correlated_noise_is_calibrated_by_its_own_accounting_not_dp_sgds(strategy):
    plan = _plan(strategy)
    target = PrivacyPlan(selection=plan.selection, clipping=Clipping(1.0),
                         noise=Noise(target_epsilon=3.0, strategy=strategy), delta=1e-5)
    sigma = calibrated(target, epochs=2).noise.multiplier
    assert plan.accounting.strategy == strategy and not plan.accounting.plain
    assert sigma == get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1,
                                         epochs=2, accountant="prv", sampling=plan.accounting)
    assert sigma != pytest.approx(get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1, epochs=2, accountant="prv"),
        rel=0.02)


def test_independent_noise_is_charged_as_dp_sgd():
    assert _plan(Independent()).accounting.plain
    assert _plan(Independent()).accounting.strategy is None


@pytest.mark.parametrize("kwargs,key", [({"kind": "banded"}, "noise_bands"),
                                        ({"kind": "independent", "bands": 3}, "noise_bands"),
                                        ({"kind": "banded", "bands": 3, "buffers": 2},
                                         "noise_buffers"),
                                        ({"kind": "banded", "bands": 40}, "noise_bands"),
                                        ({"kind": "gaussian"}, "privacy.noise")])
def test_strategy_keys_that_cannot_be_used_are_refused_by_name(kwargs, key):
    kind = kwargs.pop("kind")
    with pytest.raises(ConfigError, match=key):
        strategy_for(kind, 20, **kwargs)


# -- optimised losses ----------------------------------------------------------------------
def test_independent_noise_has_the_dp_sgd_loss():
    assert toeplitz.loss([1.0], 50) == pytest.approx(51 / 2)


@pytest.mark.parametrize("steps,bands", [(64, 4), (500, 16)])
def test_optimised_bands_beat_their_start_and_independent_noise(steps, bands):
    loss = toeplitz.loss(Banded.optimised(bands, steps).coefficients, steps)
    start = sqrt_prefix_coefficients(bands)
    assert loss < toeplitz.loss(start / np.linalg.norm(start), steps) < toeplitz.loss([1.0], steps)


def test_optimised_bands_for_momentum_beat_those_for_plain_sgd_on_momentums_workload():
    steps, bands, beta = 200, 8, 0.9
    plain = Banded.optimised(bands, steps).coefficients
    momentum = Banded.optimised(bands, steps, momentum=beta).coefficients
    assert toeplitz.loss(momentum, steps, momentum=beta) < toeplitz.loss(plain, steps,
                                                                         momentum=beta)


@pytest.mark.parametrize("steps,buffers,min_sep,rounds", [(100, 2, 1, 1), (300, 3, 30, 10)])
def test_an_optimised_blt_beats_independent_noise(steps, buffers, min_sep, rounds):
    blt = Blt.optimised(buffers, steps, min_sep=min_sep, max_participations=rounds)
    loss = blt_loss(np.array(blt.buf_decay), np.array(blt.output_scale), steps,
                    min_sep=min_sep, max_participations=rounds)
    assert loss < 0.2 * toeplitz.loss([1.0], steps, min_sep=min_sep, max_participations=rounds)


# -- against JAX Privacy -------------------------------------------------------------------
@pytest.fixture(scope="module")
def jax_mf():
    jax = pytest.importorskip("jax", reason="JAX Privacy (a test-only dependency) is needed")
    jax.config.update("jax_enable_x64", True)
    mf = pytest.importorskip("jax_privacy.matrix_factorization",
                             reason="JAX Privacy (a test-only dependency) is not installed")
    return mf


@pytest.mark.parametrize("steps,sep,rounds", [(40, 1, 1), (40, 4, 5), (37, 5, None)])
def test_the_loss_and_sensitivity_match_jax_privacys(jax_mf, steps, sep, rounds):
    column = Blt((0.95, 0.6), (0.3, 0.25)).toeplitz_column(steps)
    ours = toeplitz.min_separation_sensitivity_squared(column, steps, sep, rounds)
    theirs = float(jax_mf.toeplitz.minsep_sensitivity_squared(column, sep, rounds))
    assert ours == pytest.approx(theirs, rel=1e-12)
    bands = np.array([0.8, 0.5, 0.3])
    assert toeplitz.loss(bands, steps) == pytest.approx(
        float(jax_mf.toeplitz.loss(bands, steps)), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("steps,bands", [(100, 4), (1000, 16)])
def test_optimised_bands_are_as_good_as_jax_privacys(jax_mf, steps, bands):
    ours = toeplitz.loss(Banded.optimised(bands, steps).coefficients, steps)
    theirs = toeplitz.loss(np.asarray(jax_mf.toeplitz.optimize_banded_toeplitz(steps, bands)),
                           steps)
    assert ours <= theirs * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("steps,buffers,sep,rounds", [(100, 2, 1, 1), (1000, 3, 100, 10)])
def test_an_optimised_blt_is_within_a_percent_of_jax_privacys(jax_mf, steps, buffers, sep,
                                                               rounds):
    ours = Blt.optimised(buffers, steps, min_sep=sep, max_participations=rounds)
    theirs = jax_mf.buffered_toeplitz.optimize(n=steps, min_sep=sep, max_participations=rounds,
                                               error="mean", min_buffers=buffers,
                                               max_buffers=buffers)
    kwargs = {"min_sep": sep, "max_participations": rounds}
    assert blt_loss(np.array(ours.buf_decay), np.array(ours.output_scale), steps, **kwargs) <= \
        1.01 * blt_loss(np.asarray(theirs.buf_decay), np.asarray(theirs.output_scale), steps,
                        **kwargs)
