"""DPOptimizer: the private step on hand-made per-sample gradients (micro-batch ground truth)."""

from __future__ import annotations

import math

import pytest
import torch
from privacy_helpers import (
    LOSS,
    FakeSource,
    clipped_sum,
    per_sample_grads,
    std_tolerance,
    tiny_data,
    tiny_model,
)

from dptrain.data.batch_record import BatchRecord
from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.privacy import AdaptiveClipper, DPOptimizer, FlatClipper, PerLayerClipper
from dptrain.randomness import make_generator
from dptrain.privacy.schedules import ExponentialSchedule, StepSchedule
from tests.op_tally import OpTally, fresh_outputs


def _setup(sigma: float = 0.0, C: float = 1.0, ebs: float = 8.0, q: float = 0.5,
           optimizer_cls=torch.optim.SGD, seed: int = 0, **kwargs):
    model = tiny_model()
    source = FakeSource(model)
    opt = optimizer_cls(model.parameters(), lr=1.0)
    dp = DPOptimizer(opt, sigma, C, ebs, module=source, sample_rate=q,
                     noise_generator=make_generator(seed), **kwargs)
    return model, source, dp


def _clipped_mean(grads, C: float, ebs: float):
    return {p: s / ebs for p, s in clipped_sum(grads, C).items()}


def test_with_sigma_zero_the_update_is_the_mean_of_clipped_per_sample_gradients():
    model, source, dp = _setup(sigma=0.0, C=0.5, ebs=8.0)
    x, y = tiny_data(8)
    grads = per_sample_grads(model, LOSS, x, y)
    expected = _clipped_mean(grads, 0.5, 8.0)
    before = {p: p.detach().clone() for p in model.parameters()}
    source.capture(grads)
    dp.step()
    for p in model.parameters():
        torch.testing.assert_close(before[p] - p.detach(), expected[p], rtol=1e-6, atol=1e-9)


def test_the_update_divides_by_the_expected_batch_size_not_the_actual_one():
    model, source, dp = _setup(sigma=0.0, C=100.0, ebs=20.0)
    x, y = tiny_data(4)
    grads = per_sample_grads(model, LOSS, x, y)
    source.capture(grads)
    dp.step()
    for p in model.parameters():
        torch.testing.assert_close(p.grad, grads[p].sum(0) / 20.0, rtol=1e-6, atol=1e-9)


def test_during_the_step_hooks_summed_grad_holds_the_noiseless_clipped_sum_and_grad_the_noisy_one():
    model, source, dp = _setup(sigma=1.0, C=0.5, ebs=8.0)
    x, y = tiny_data(8)
    grads = per_sample_grads(model, LOSS, x, y)
    expected = _clipped_mean(grads, 0.5, 8.0)
    seen = []
    dp.attach_step_hook(lambda opt: seen.append({p: (p.summed_grad, p.grad) for p in opt.params}))
    source.capture(grads)
    dp.step()
    for p in model.parameters():
        summed, noisy = seen[0][p]
        torch.testing.assert_close(summed / 8.0, expected[p], rtol=1e-6, atol=1e-9)
        assert not torch.allclose(noisy, expected[p])


def test_after_the_step_no_parameter_keeps_the_noise_free_sum_so_pickling_cannot_leak_it():
    import io

    model, source, dp = _setup(sigma=1.0, C=0.5, ebs=8.0)
    source.capture(per_sample_grads(model, LOSS, *tiny_data(8)))
    dp.step()
    assert all(getattr(p, "summed_grad", None) is None for p in model.parameters())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    reloaded = torch.load(buffer, weights_only=False)
    assert all(getattr(p, "summed_grad", None) is None for p in reloaded.parameters())


def test_zero_grad_clears_grad_and_summed_grad():
    model, source, dp = _setup(sigma=1.0)
    x, y = tiny_data(4)
    source.capture(per_sample_grads(model, LOSS, x, y))
    dp.step()
    dp.zero_grad()
    assert all(p.grad is None and p.summed_grad is None for p in model.parameters())


def test_added_noise_std_is_sigma_times_C_over_expected_batch_size():
    sigma, C, ebs = 1.3, 0.7, 5.0
    model = torch.nn.Linear(1000, 100, bias=False).double()
    source = FakeSource(model)
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), sigma, C, ebs, module=source,
                     sample_rate=0.1, noise_generator=make_generator(3))
    draws = []
    for _ in range(2):
        dp.step()  # empty batch: p.grad is pure noise
        draws.append(model.weight.grad.flatten())
        dp.zero_grad()
    noise = torch.cat(draws)
    expected = sigma * C / ebs
    assert abs(noise.std().item() / expected - 1) < std_tolerance(noise.numel())
    assert abs(noise.mean().item()) < 6 * expected / math.sqrt(noise.numel())


def test_the_noisy_gradient_is_noise_drawn_at_std_over_batch_size_plus_the_scaled_clipped_sum():
    sigma, C, ebs = 1.3, 0.5, 6.0
    model, source, dp = _setup(sigma=sigma, C=C, ebs=ebs, seed=7)
    seen = []
    dp.attach_step_hook(lambda opt: seen.append({p: (p.summed_grad.clone(), p.grad.clone()) for p in opt.params}))
    source.capture(per_sample_grads(model, LOSS, *tiny_data(8)))
    dp.step()
    replay = make_generator(7)
    for p in dp.params:
        summed, noisy = seen[0][p]
        noise = torch.normal(0.0, sigma * C / ebs, size=p.shape, generator=replay, dtype=p.dtype)
        assert torch.equal(noisy, noise.add_(summed, alpha=1 / ebs))


def test_writing_the_noisy_gradients_allocates_one_gradient_sized_buffer_per_parameter():
    model = torch.nn.Linear(300, 200)
    source = FakeSource(model)
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1.0, 1.0, 4.0, module=source,
                     sample_rate=0.5, noise_generator=make_generator(0))
    source.capture({p: torch.randn(4, *p.shape) for p in model.parameters()})
    dp.clip_and_accumulate()
    with OpTally(lambda func, args, kwargs, out: sum(t.numel() for t in fresh_outputs(args, kwargs, out))) as allocated:
        dp._write_noisy_gradients()
    assert allocated.total <= sum(p.numel() for p in model.parameters())


def test_an_empty_batch_still_adds_noise_and_runs_the_step_hooks():
    model, _source, dp = _setup(sigma=1.0)
    seen = []
    dp.attach_step_hook(lambda opt: seen.append((opt.noise_multiplier, opt.sample_rate)))
    dp.step()
    assert seen == [(1.0, 0.5)]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_skipped_steps_accumulate_and_the_final_step_equals_one_big_batch():
    x, y = tiny_data(9)
    model_a, source_a, dp_a = _setup(sigma=0.0, C=0.3, ebs=9.0)
    model_b, source_b, dp_b = _setup(sigma=0.0, C=0.3, ebs=9.0)
    grads = per_sample_grads(model_a, LOSS, x, y)
    source_a.capture(grads)
    dp_a.step()
    for rows in (slice(0, 4), slice(4, 8), slice(8, 9)):
        source_b.capture({p: g[rows] for p, g in per_sample_grads(model_b, LOSS, x, y).items()})
        dp_b.signal_skip_step(rows.stop < 9)
        dp_b.step()
        if rows.stop < 9:
            dp_b.zero_grad()  # a user's loop zeroes between chunks: summed_grad must survive
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-7, atol=1e-10)


def test_a_skipped_step_does_not_touch_the_parameters_or_the_hooks():
    model, source, dp = _setup(sigma=1.0)
    calls = []
    dp.attach_step_hook(calls.append)
    before = [p.detach().clone() for p in model.parameters()]
    dp.signal_skip_step(True)
    source.capture(per_sample_grads(model, LOSS, *tiny_data(3)))
    dp.step()
    assert calls == []
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_released_clipped_sum_is_not_carried_into_the_next_step_without_zero_grad():
    model, source, dp = _setup(sigma=0.0, C=100.0, ebs=1.0)
    x, y = tiny_data(2)
    source.capture(per_sample_grads(model, LOSS, x[:1], y[:1]))
    dp.step()
    second = per_sample_grads(model, LOSS, x[1:], y[1:])
    source.capture(second)
    dp.step()  # no zero_grad in between
    for p in model.parameters():
        torch.testing.assert_close(p.grad, second[p][0])  # sigma 0, expected batch size 1


def test_per_layer_noise_uses_the_total_sensitivity():
    model = torch.nn.Linear(300, 100).double()
    params = list(model.parameters())
    clipper = PerLayerClipper([0.3, 0.4], params)
    dp = DPOptimizer(torch.optim.SGD(params, lr=0.0), 2.0, None, 1.0, clipper,
                     module=FakeSource(model), sample_rate=0.1, noise_generator=make_generator(0))
    dp.step()
    noise = torch.cat([p.grad.flatten() for p in params])
    assert dp.max_grad_norm == pytest.approx(0.5)
    assert abs(noise.std().item() / (2.0 * 0.5) - 1) < std_tolerance(noise.numel())


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                                           torch.optim.RMSprop])
def test_any_torch_optimizer_steps_on_the_private_gradient(optimizer_cls):
    model, source, dp = _setup(sigma=0.0, optimizer_cls=optimizer_cls)
    reference = tiny_model()
    ref_opt = optimizer_cls(reference.parameters(), lr=1.0)
    grads = per_sample_grads(model, LOSS, *tiny_data(8))
    private = _clipped_mean(grads, 1.0, 8.0)
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        p_ref.grad = private[p].clone()
    ref_opt.step()
    source.capture(grads)
    dp.step()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p_ref, p, rtol=1e-5, atol=1e-8)


def test_seeded_noise_repeats_exactly():
    grads_runs = []
    for _ in range(2):
        model, _source, dp = _setup(sigma=1.0, seed=42)
        dp.step()
        grads_runs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads_runs))


def test_secure_mode_noise_differs_between_identical_runs():
    grads_runs = []
    for _ in range(2):
        model = tiny_model()
        dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), 1.0, 1.0, 4.0,
                         module=FakeSource(model), sample_rate=0.5, secure_mode=True)
        dp.step()
        grads_runs.append([p.grad.clone() for p in model.parameters()])
    assert not any(torch.equal(a, b) for a, b in zip(*grads_runs))


def test_noise_schedule_values_reach_the_step_hooks():
    _model, _source, dp = _setup(sigma=2.0, noise_schedule=ExponentialSchedule(2.0, 0.5))
    seen = []
    dp.attach_step_hook(lambda opt: seen.append(opt.noise_multiplier))
    for _ in range(3):
        dp.step()
    assert seen == [2.0, 1.0, 0.5]


def test_sample_rate_schedule_updates_sample_rate_and_expected_batch_size():
    _model, _source, dp = _setup(ebs=8.0, q=0.5, sample_rate_schedule=StepSchedule(0.5, 1, 0.5))
    seen = []
    dp.attach_step_hook(lambda opt: seen.append((opt.sample_rate, opt.expected_batch_size)))
    dp.step()
    dp.step()
    assert seen == [(0.5, 8.0), (0.25, 4.0)]


def test_a_schedule_value_that_is_not_a_valid_sigma_raises_privacy_error():
    with pytest.raises(PrivacyError, match="noise_schedule"):
        _setup(sigma=1.0, noise_schedule=lambda step: -1.0)


def test_closure_is_evaluated_before_the_private_step():
    model, source, dp = _setup(sigma=0.0)
    x, y = tiny_data(4)

    def closure():
        source.capture(per_sample_grads(model, LOSS, x, y))
        return torch.tensor(1.5)

    assert dp.step(closure).item() == 1.5
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_dp_state_dict_round_trip_restores_step_count_and_schedule_values():
    _, _, dp = _setup(sigma=2.0, noise_schedule=ExponentialSchedule(2.0, 0.5))
    dp.step()
    dp.step()
    _, _, fresh = _setup(sigma=2.0, noise_schedule=ExponentialSchedule(2.0, 0.5))
    fresh.load_dp_state_dict(dp.dp_state_dict())
    assert (fresh.steps_taken, fresh.noise_multiplier) == (2, 0.5)


def test_wrapping_a_dp_optimizer_again_is_a_config_error():
    _, source, dp = _setup()
    with pytest.raises(ConfigError, match="already a DPOptimizer"):
        DPOptimizer(dp, 1.0, 1.0, 4.0, module=source, sample_rate=0.5)


def test_negative_noise_multiplier_is_a_privacy_error_naming_it():
    with pytest.raises(PrivacyError, match="noise_multiplier"):
        _setup(sigma=-0.1)


def test_a_clipper_disagreeing_with_max_grad_norm_is_a_config_error():
    model = tiny_model()
    with pytest.raises(ConfigError, match="max_grad_norm"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), 1.0, 2.0, 4.0, FlatClipper(1.0),
                    module=FakeSource(model), sample_rate=0.5)


def test_works_under_a_torch_lr_scheduler():
    _model, _source, dp = _setup(sigma=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(dp, step_size=1, gamma=0.1)
    dp.step()
    scheduler.step()
    assert dp.param_groups[0]["lr"] == pytest.approx(0.1)


def test_adaptive_clipping_noises_the_gradient_with_the_raised_multiplier():
    model = torch.nn.Linear(500, 100, bias=False).double()
    clipper = AdaptiveClipper(0.5, 0.5, 0.2, count_noise_std=1.0)
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), 1.0, None, 2.0, clipper,
                     module=FakeSource(model), sample_rate=0.1, noise_generator=make_generator(0))
    z_grad = clipper.gradient_noise_multiplier(1.0)
    dp.step()
    noise = model.weight.grad.flatten()
    assert abs(noise.std().item() / (z_grad * 0.5 / 2.0) - 1) < std_tolerance(noise.numel())


SIXTEEN_BIT = [torch.bfloat16, torch.float16]


def _sixteen_bit_model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Embedding -> Conv1d -> LayerNorm -> Linear in `dtype`: every clipped-sum route of ghost
    mode (embedding rule, conv kernel, outer products, and with strategy="ghost" the
    normalisation layer's re-run)."""
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(20, 8)
            self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2)
            return self.head(torch.tanh(self.norm(h))).sum(dim=1)

    return Net().to(dtype)


def _sixteen_bit_source(model: torch.nn.Module, mode: str):
    if mode == "hooks":
        return GradSampleModule(model, loss_reduction="sum")
    return GhostClippingModule(model, loss_reduction="sum", strategy=mode)


#: (weights' dtype, autocast dtype or None): bf16 and fp16 weights, bf16 autocast of float32 weights.
PRECISIONS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
              "bf16-autocast": (torch.float32, torch.bfloat16)}


def _noise_free_sum_of_one_example(precision, mode, clipping, seed, C):
    """{p: float64 copy of p.summed_grad} read by a step hook, after one step on ONE example whose
    gradient norm is far above C, and the clipper."""
    dtype, autocast = PRECISIONS[precision]
    model = _sixteen_bit_model(dtype, seed)
    source = _sixteen_bit_source(model, mode)
    params = list(model.parameters())
    clipper = FlatClipper(C) if clipping == "flat" else PerLayerClipper(C, params)
    dp = DPOptimizer(torch.optim.SGD(params, lr=0.0), 0.0, None, 1.0, clipper, module=source,
                     sample_rate=0.5)
    seen = {}
    dp.attach_step_hook(lambda opt: seen.update({p: p.summed_grad.detach().double() for p in opt.params}))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (1, 6), generator=gen)
    target = torch.randint(0, 5, (1,), generator=gen)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = source(ids)
    torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum").backward()
    dp.step()
    return seen, clipper


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "instantiate"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_in_16_bit_precision_one_examples_noise_free_contribution_is_at_most_C(precision, mode, clipping):
    C, worst = 0.01, 0.0
    for seed in range(16):
        summed, clipper = _noise_free_sum_of_one_example(precision, mode, clipping, seed, C)
        worst = max(worst, math.sqrt(sum(float(s.square().sum()) for s in summed.values())))
        if clipping == "per_layer":
            assert all(float(s.norm()) <= clipper.bounds[p] for p, s in summed.items())
    assert worst <= C, f"one example's clipped contribution reached {worst / C!r} C"


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "fp16"])
def test_16_bit_parameters_accumulate_their_clipped_sum_over_chunks_in_float32(dtype):
    model = torch.nn.Linear(3, 2).to(dtype)
    source = GradSampleModule(model, loss_reduction="sum")
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 0.0, 1e6, 4.0, module=source,
                     sample_rate=0.5)
    seen = {}
    dp.attach_step_hook(lambda opt: seen.update({p: p.summed_grad.clone() for p in opt.params}))
    exact = {p: torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()}
    for chunk in range(3):  # unclipped (C = 1e6): the sum is the sum of the per-sample gradients
        source(torch.randn(2, 3, generator=torch.Generator().manual_seed(chunk)).to(dtype)).sum().backward()
        for p in model.parameters():
            exact[p] += p.grad_sample.double().sum(0)
        dp.signal_skip_step(chunk < 2)
        dp.step()
    for p in model.parameters():
        assert seen[p].dtype == torch.float32
        torch.testing.assert_close(seen[p].double(), exact[p], rtol=1e-6, atol=0.0)
        assert p.grad.dtype == dtype and torch.equal(p.grad, (seen[p] / 4.0).to(dtype))


def test_bfloat16_parameters_get_a_bfloat16_noisy_gradient():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    source = FakeSource(model)
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1.0, 1.0, 4.0, module=source,
                     sample_rate=0.5, noise_generator=make_generator(0))
    source.capture({p: torch.randn(4, *p.shape).to(torch.bfloat16) for p in model.parameters()})
    dp.step()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in model.parameters())


class _RecordingLoader:
    """A private loader's side of the link: hands out records (dptrain.data.batch_record)."""

    def __init__(self):
        self.listeners, self.record = [], None

    def add_hand_out_listener(self, listener):
        self.listeners.append(listener)

    def last_record(self):
        return self.record

    def hand_out(self, record):
        self.record = record
        for listener in self.listeners:
            listener()


def test_a_released_record_sets_the_steps_q_and_expected_batch_size():
    _model, _source, dp = _setup(ebs=8.0, q=0.5)  # N = 16
    seen = []
    dp.attach_step_hook(lambda opt: seen.append((opt.sample_rate, opt.expected_batch_size)))
    charge = dp.release(BatchRecord(index=3, sample_rate=0.25, indices=(1, 5)))
    assert seen == [(0.25, 4.0)]
    assert (charge.sample_rate, charge.batch_index, charge.batch_size, charge.step) == (0.25, 3, 2, 0)


def test_a_linked_step_releases_the_record_of_the_batch_handed_out_last():
    _model, _source, dp = _setup(ebs=8.0, q=0.5)  # N = 16
    loader = _RecordingLoader()
    dp.follow_loader(loader)
    charges = []
    dp.add_charge_listener(charges.append)
    loader.hand_out(BatchRecord(index=0, sample_rate=0.125))
    dp.step()
    assert [(c.sample_rate, c.batch_index) for c in charges] == [(0.125, 0)]
    assert dp.expected_batch_size == 2.0


def test_releasing_a_record_that_is_not_the_batch_handed_out_last_is_refused():
    _model, _source, dp = _setup(ebs=8.0, q=0.5)
    loader = _RecordingLoader()
    dp.follow_loader(loader)
    charges = []
    dp.add_charge_listener(charges.append)
    stale = BatchRecord(index=0, sample_rate=0.5)
    loader.hand_out(stale)
    loader.hand_out(BatchRecord(index=1, sample_rate=0.125))
    with pytest.raises(PrivacyError, match="batch 0 .* handed out last is batch 1"):
        dp.release(stale)
    assert charges == [] and dp.steps_taken == 0


@pytest.mark.parametrize("argument", ["noise_multiplier", "sample_rate"])
def test_a_bool_is_not_a_noise_multiplier_or_sample_rate(argument):
    kwargs = {"sigma": True} if argument == "noise_multiplier" else {"q": True}
    with pytest.raises(PrivacyError, match=argument):
        _setup(**kwargs)
