"""Clipping strategies: flat, per-layer and adaptive, on micro-batch per-sample gradients."""

from __future__ import annotations

import math

import pytest
import torch
from privacy_helpers import LOSS, FakeSource, per_sample_grads, tiny_data, tiny_model

from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy import AdaptiveClipper, FlatClipper, PerLayerClipper, make_clipper


def _source_with(grads) -> FakeSource:
    source = FakeSource(torch.nn.Identity())
    source.capture(grads)
    return source


def _per_sample_contributions(clipper, grads) -> list[dict]:
    """Each sample's clipped contribution, by clipping a source holding that sample alone."""
    batch = next(iter(grads.values())).shape[0]
    return [clipper.clip(_source_with({p: g[b:b + 1] for p, g in grads.items()}))
            for b in range(batch)]


def test_flat_clipping_bounds_every_samples_total_norm_by_C():
    model = tiny_model()
    grads = per_sample_grads(model, LOSS, *tiny_data(16))
    for contribution in _per_sample_contributions(FlatClipper(0.2), grads):
        total = math.sqrt(sum(t.pow(2).sum().item() for t in contribution.values()))
        assert total <= 0.2 * (1 + 1e-12)


def test_flat_clipping_leaves_samples_below_C_unchanged():
    model = tiny_model()
    grads = per_sample_grads(model, LOSS, *tiny_data(4))
    sums = FlatClipper(1e6).clip(_source_with(grads))
    for p, g in grads.items():
        torch.testing.assert_close(sums[p], g.sum(0), rtol=1e-9, atol=0.0)


def test_flat_clipping_scales_a_large_sample_to_norm_exactly_C():
    model = tiny_model()
    grads = per_sample_grads(model, LOSS, *tiny_data(1))
    sums = FlatClipper(1e-3).clip(_source_with(grads))
    total = math.sqrt(sum(t.pow(2).sum().item() for t in sums.values()))
    assert total == pytest.approx(1e-3, rel=1e-4)


def test_per_layer_clipping_bounds_each_parameter_by_its_own_threshold():
    model = tiny_model()
    params = list(model.parameters())
    bounds = [0.1, 0.2, 0.3, 0.4]
    grads = per_sample_grads(model, LOSS, *tiny_data(8))
    for contribution in _per_sample_contributions(PerLayerClipper(bounds, params), grads):
        for p, bound in zip(params, bounds):
            assert contribution[p].norm().item() <= bound * (1 + 1e-12)


def test_per_layer_default_splits_C_equally_so_the_sensitivity_is_C():
    params = list(tiny_model().parameters())
    clipper = PerLayerClipper(2.0, params)
    assert all(b == pytest.approx(2.0 / math.sqrt(4)) for b in clipper.bounds.values())
    assert clipper.max_grad_norm == pytest.approx(2.0)


def test_per_layer_sensitivity_is_the_root_sum_of_squared_thresholds():
    params = list(tiny_model().parameters())
    assert PerLayerClipper([1.0, 2.0, 2.0, 4.0], params).max_grad_norm == pytest.approx(5.0)


def test_per_layer_threshold_list_of_the_wrong_length_is_a_config_error():
    params = list(tiny_model().parameters())
    with pytest.raises(ConfigError, match="max_grad_norm has 2 per-layer bounds"):
        PerLayerClipper([1.0, 2.0], params)


def test_non_positive_clipping_norm_is_a_privacy_error_naming_max_grad_norm():
    with pytest.raises(PrivacyError, match="max_grad_norm"):
        FlatClipper(0.0)


def test_adaptive_gradient_noise_follows_andrews_theorem():
    clipper = AdaptiveClipper(1.0, 0.5, 0.2, count_noise_std=2.0)
    z_grad = clipper.gradient_noise_multiplier(1.0)
    assert z_grad ** -2 + (2 * 2.0) ** -2 == pytest.approx(1.0 ** -2)
    assert z_grad > 1.0


def test_adaptive_count_noise_too_small_for_sigma_is_a_privacy_error():
    clipper = AdaptiveClipper(1.0, 0.5, 0.2, count_noise_std=0.4)
    with pytest.raises(PrivacyError, match="count_noise_std"):
        clipper.gradient_noise_multiplier(1.0)


def test_adaptive_bound_shrinks_when_more_samples_than_the_target_are_unclipped():
    grads = per_sample_grads(tiny_model(), LOSS, *tiny_data(8))
    clipper = AdaptiveClipper(1e6, 0.5, 0.2, count_noise_std=0.0)
    clipper.clip(_source_with(grads))
    clipper.end_step(lambda std: 0.0, expected_batch_size=8.0)
    assert clipper.max_grad_norm == pytest.approx(1e6 * math.exp(-0.2 * (1.0 - 0.5)))


def test_adaptive_bound_grows_when_fewer_samples_than_the_target_are_unclipped():
    grads = per_sample_grads(tiny_model(), LOSS, *tiny_data(8))
    clipper = AdaptiveClipper(1e-9, 0.5, 0.2, count_noise_std=0.0)
    clipper.clip(_source_with(grads))
    clipper.end_step(lambda std: 0.0, expected_batch_size=8.0)
    assert clipper.max_grad_norm == pytest.approx(1e-9 * math.exp(0.2 * 0.5))


def test_adaptive_bound_converges_to_the_target_quantile_of_norms():
    norms = torch.linspace(0.1, 10.0, 100, dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    clipper = AdaptiveClipper(50.0, 0.3, 0.2, count_noise_std=0.0)
    for _ in range(400):
        clipper.clip(_source_with({p: norms.view(-1, 1)}))
        clipper.end_step(lambda std: 0.0, expected_batch_size=100.0)
    assert torch.quantile(norms, 0.28) < clipper.max_grad_norm < torch.quantile(norms, 0.32)


def test_make_clipper_rejects_an_unknown_mode_naming_clipping():
    with pytest.raises(ConfigError, match="clipping='huber'"):
        make_clipper("huber", 1.0, [], expected_batch_size=1.0)


def test_make_clipper_default_count_noise_is_a_twentieth_of_the_expected_batch():
    clipper = make_clipper("adaptive", 1.0, [], expected_batch_size=200.0)
    assert clipper.count_noise_std == pytest.approx(10.0)


def test_adaptive_state_dict_round_trip_restores_the_bound():
    clipper = AdaptiveClipper(3.0, 0.5, 0.2, count_noise_std=1.0)
    clipper.end_step(lambda std: 0.0, expected_batch_size=4.0)
    fresh = AdaptiveClipper(1.0, 0.5, 0.2, count_noise_std=1.0)
    fresh.load_state_dict(clipper.state_dict())
    assert fresh.max_grad_norm == clipper.max_grad_norm


def _released_count(clipper, grads) -> float:
    """The noiseless released count of one logical batch, in samples: (b - 1/2) * expected size."""
    clipper.clip(_source_with(grads))
    fraction = clipper.noisy_unclipped_fraction(lambda std: 0.0, expected_batch_size=8.0)
    clipper.reset_accumulation()
    return (fraction - 0.5) * 8.0


def test_adaptive_released_count_moves_by_at_most_half_when_one_sample_is_removed():
    # Theorem 1 charges the count as a Gaussian mechanism with multiplier 2 sigma_b, which holds
    # only if adding or removing one example moves the released count by at most 1/2.
    grads = per_sample_grads(tiny_model(), LOSS, *tiny_data(8))
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    clipper = AdaptiveClipper(float(norms.median()), 0.5, 0.2, count_noise_std=1.0)
    full = _released_count(clipper, grads)
    for b in range(8):
        keep = [i for i in range(8) if i != b]
        without_b = _released_count(clipper, {p: g[keep] for p, g in grads.items()})
        assert abs(full - without_b) == pytest.approx(0.5)


def test_adaptive_noisy_fraction_is_clamped_to_zero_one():
    grads = per_sample_grads(tiny_model(), LOSS, *tiny_data(4))
    clipper = AdaptiveClipper(1.0, 0.5, 0.2, count_noise_std=1.0)
    clipper.clip(_source_with(grads))
    assert clipper.noisy_unclipped_fraction(lambda std: 1e6, expected_batch_size=4.0) == 1.0
    assert clipper.noisy_unclipped_fraction(lambda std: -1e6, expected_batch_size=4.0) == 0.0


class _SixteenBitSums(FakeSource):
    """A per-sample source that rounds its clipped sums to the parameters' 16-bit dtype."""

    def weighted_sum(self, weights):
        return {p: s.to(p.dtype) for p, s in super().weighted_sum(weights).items()}


def test_a_source_returning_16_bit_clipped_sums_is_refused_naming_weighted_sum():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    source = _SixteenBitSums(model)
    source.capture({p: torch.randn(4, *p.shape).to(torch.bfloat16) for p in model.parameters()})
    with pytest.raises(PrivacyError, match=r"_SixteenBitSums\.weighted_sum returned torch\.bfloat16"):
        FlatClipper(1.0).clip(source)


def test_the_finite_test_of_squared_totals_is_torch_isfinite_for_every_float64_class() -> None:
    """`finite_totals` (|x| < inf, two kernels) keeps exactly the samples `torch.isfinite` keeps:
    NaN and both infinities out; zeros, subnormals, the largest float64 and negatives in."""
    from dptrain.privacy.clipping import finite_totals

    tiny, big = torch.finfo(torch.float64).tiny, torch.finfo(torch.float64).max
    totals = torch.tensor([0.0, -0.0, tiny / 4, tiny, 1.0, big, -big, math.inf, -math.inf, math.nan],
                          dtype=torch.float64)
    assert torch.equal(finite_totals(totals), torch.isfinite(totals))
