"""GradSampleModule behaviour: capture rules, accumulation, hooks, state dict, bad input."""

import pytest
import torch
from torch import nn

import dptrain
from dptrain.errors import ConfigError, UnsupportedModuleError
from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.layers import DPLSTM
from tests.grad_sample.conftest import assert_per_sample_exact, sum_of_outputs

F64 = torch.float64


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()


class SharedTwice(nn.Module):
    """The same Linear applied twice in one forward (shared weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x)))


def test_shared_layer_gets_the_sum_of_both_uses(random_targets) -> None:
    model = SharedTwice()
    x = torch.randn(4, 3, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


def test_tied_parameter_in_two_modules_gets_the_sum_of_both() -> None:
    emb, head = nn.Embedding(5, 3, dtype=F64), nn.Linear(3, 5, bias=False, dtype=F64)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    idx = torch.tensor([[1, 2], [3, 3], [0, 4]])
    assert_per_sample_exact(model, idx, torch.randn(3, 2, 5, dtype=F64))


def test_two_passes_before_consumption_concatenate_along_the_batch() -> None:
    model = mlp()
    x1, x2 = torch.randn(3, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    t1, t2 = torch.randn(3, 2, dtype=F64), torch.randn(2, 2, dtype=F64)
    expected = microbatch_grad_samples(model, torch.cat([x1, x2]), torch.cat([t1, t2]), sum_of_outputs)
    gsm = dptrain.GradSampleModule(model, loss_reduction="sum")
    sum_of_outputs(gsm(x1), t1).backward()
    sum_of_outputs(gsm(x2), t2).backward()
    for name, p in gsm.trainable_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name])
    assert gsm.per_sample_batch_size() == 5


def test_mean_reduction_uses_each_pass_own_batch_size() -> None:
    model = mlp()
    x1, x2 = torch.randn(3, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    y1, y2 = torch.randn(3, 2, dtype=F64), torch.randn(2, 2, dtype=F64)
    expected = microbatch_grad_samples(model, torch.cat([x1, x2]), torch.cat([y1, y2]), nn.MSELoss())
    gsm = dptrain.GradSampleModule(model, loss_reduction="mean")
    nn.MSELoss()(gsm(x1), y1).backward()
    nn.MSELoss()(gsm(x2), y2).backward()
    for name, p in gsm.trainable_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name])


def test_input_requiring_grad_does_not_change_the_per_sample_gradients(random_targets) -> None:
    model = mlp()
    x = torch.randn(4, 4, dtype=F64, requires_grad=True)
    assert_per_sample_exact(model, x, random_targets(model, x))


class TwoBranches(nn.Module):
    """Two Linear layers; ``forward(x, branch)`` runs the one named ``branch``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 1, dtype=F64), nn.Linear(2, 1, dtype=F64)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return self.a(x) if branch == "a" else self.b(x)


def test_layer_unused_in_one_pass_gets_zero_rows_for_it() -> None:
    model = TwoBranches()
    a, b = model.a, model.b
    gsm = dptrain.GradSampleModule(model, loss_reduction="sum")
    gsm(torch.randn(3, 2, dtype=F64), branch="a").sum().backward()
    gsm(torch.randn(2, 2, dtype=F64), branch="b").sum().backward()
    assert a.weight.grad_sample.shape == b.weight.grad_sample.shape == (5, 1, 2)
    assert a.weight.grad_sample[3:].abs().max() == 0 and b.weight.grad_sample[:3].abs().max() == 0


def test_frozen_parameters_get_no_grad_sample() -> None:
    model = mlp()
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    gsm = dptrain.GradSampleModule(model)
    gsm(torch.randn(3, 4, dtype=F64)).sum().backward()
    assert model[0].bias.grad_sample.shape == (3, 3)
    assert not hasattr(model[0].weight, "grad_sample") and not hasattr(model[2].weight, "grad_sample")


def test_frozen_layer_keeps_per_sample_gradients_of_earlier_layers_exact(random_targets) -> None:
    model = mlp()
    model[2].requires_grad_(False)
    x = torch.randn(4, 4, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


def test_eval_mode_and_no_grad_capture_nothing() -> None:
    model = mlp()
    gsm = dptrain.GradSampleModule(model)
    with torch.no_grad():
        gsm(torch.randn(3, 4, dtype=F64))
    gsm.eval()
    gsm(torch.randn(3, 4, dtype=F64)).sum().backward()
    assert model[0].weight.grad is not None
    assert getattr(model[0].weight, "grad_sample", None) is None
    assert gsm.per_sample_batch_size() == 0


def test_inplace_activation_after_a_layer_keeps_gradients_exact(random_targets) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2)).double()
    x = torch.randn(5, 4, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


def test_removed_hooks_leave_a_plain_model() -> None:
    model = mlp()
    gsm = dptrain.GradSampleModule(model)
    gsm.remove_hooks()
    model(torch.randn(3, 4, dtype=F64)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert not model._forward_hooks and not model[0]._forward_hooks


def test_state_dict_of_the_wrapper_loads_into_the_plain_model_and_back() -> None:
    model, other = mlp(), mlp()
    gsm = dptrain.GradSampleModule(model)
    assert gsm.state_dict().keys() == other.state_dict().keys()
    other.load_state_dict(gsm.state_dict())
    gsm.load_state_dict(mlp().state_dict())
    assert not torch.equal(model[0].weight, other[0].weight)
    gsm.load_state_dict(other.state_dict())
    assert torch.equal(model[0].weight, other[0].weight)


def test_trainable_parameters_use_the_model_names_in_order() -> None:
    model = mlp()
    model[2].bias.requires_grad_(False)
    names = [n for n, _ in dptrain.GradSampleModule(model).trainable_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight"]


def test_wrapper_forwards_attribute_access_to_the_model() -> None:
    model = SharedTwice()
    assert dptrain.GradSampleModule(model).fc is model.fc


def test_batchnorm_model_is_refused_naming_the_submodule_and_the_fix() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with pytest.raises(UnsupportedModuleError, match=r"'1'.*BatchNorm2d.*ModuleValidator\.fix"):
        dptrain.GradSampleModule(model)


def test_a_model_without_trainable_parameters_is_refused() -> None:
    with pytest.raises(ConfigError, match="no parameter of the model requires grad"):
        dptrain.GradSampleModule(nn.Linear(2, 2).requires_grad_(False))


def test_unknown_loss_reduction_is_refused() -> None:
    with pytest.raises(ConfigError, match="loss_reduction"):
        dptrain.GradSampleModule(mlp(), loss_reduction="none")


def test_inputs_with_different_batch_sizes_fail_clearly() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x, y):
            return self.a(x).sum() + self.b(y).sum()

    gsm = dptrain.GradSampleModule(TwoInputs())
    with pytest.raises(UnsupportedModuleError, match=r"'b'.*size 5.*batch of 3 examples.*args\[0\]"):
        gsm(torch.randn(3, 2), torch.randn(5, 2))


def test_layer_folding_time_into_the_batch_fails_clearly() -> None:
    class Folding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.fc = nn.Embedding(5, 2), nn.Linear(2, 2)

        def forward(self, idx):
            return self.fc(self.emb(idx).view(-1, 2))

    gsm = dptrain.GradSampleModule(Folding())
    with pytest.raises(UnsupportedModuleError, match="fold time into the batch"):
        gsm(torch.tensor([[1, 2, 3], [0, 1, 2]]))


class OutsideUse(nn.Module):
    """``scale.weight`` is used in the parent's forward (and, optionally, by ``scale`` itself)."""

    def __init__(self, also_inside: bool) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(2, 2), nn.Linear(2, 2, bias=False)
        self.also_inside = also_inside

    def forward(self, x):
        out = self.fc(x) @ self.scale.weight
        return self.scale(out) if self.also_inside else out


def test_parameter_used_only_outside_its_module_fails_at_backward() -> None:
    gsm = dptrain.GradSampleModule(OutsideUse(also_inside=False))
    with pytest.raises(UnsupportedModuleError, match=r"\['scale\.weight'\].*no per-sample gradient"):
        gsm(torch.randn(3, 2)).sum().backward()


def test_parameter_used_inside_and_outside_its_module_fails_on_the_first_backward() -> None:
    gsm = dptrain.GradSampleModule(OutsideUse(also_inside=True))
    with pytest.raises(UnsupportedModuleError, match=r"\['scale\.weight'\] do not add up"):
        gsm(torch.randn(3, 2)).sum().backward()


def test_a_nan_example_never_fails_the_first_backwards_sum_check_which_moves_to_the_next() -> None:
    gsm = dptrain.GradSampleModule(OutsideUse(also_inside=True))
    x = torch.randn(3, 2)
    x[1, 0] = float("nan")
    gsm(x).sum().backward()   # NaN - NaN proves nothing: no error, whatever the batch held
    gsm.zero_grad()
    gsm.zero_grad_sample()
    with pytest.raises(UnsupportedModuleError, match=r"\['scale\.weight'\] do not add up"):
        gsm(torch.randn(3, 2)).sum().backward()


def test_check_complete_refuses_gradients_computed_without_capture() -> None:
    gsm = dptrain.GradSampleModule(mlp())
    gsm.eval()
    gsm(torch.randn(3, 4, dtype=F64)).sum().backward()
    with pytest.raises(UnsupportedModuleError, match=r"\['0\.weight'.*eval mode"):
        gsm.check_complete()


def test_complete_capture_passes_check_complete() -> None:
    gsm = dptrain.GradSampleModule(mlp())
    gsm(torch.randn(3, 4, dtype=F64)).sum().backward()
    gsm.check_complete()


def test_input_modified_in_place_after_the_layer_fails_clearly() -> None:
    class Clobber(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            h = x * 1.0
            out = self.fc(h)
            h.mul_(2)
            return out

    gsm = dptrain.GradSampleModule(Clobber())
    with pytest.raises(UnsupportedModuleError, match="modified in place"):
        gsm(torch.randn(3, 2)).sum().backward()


def test_wrapping_a_model_twice_is_refused() -> None:
    model = mlp()
    dptrain.GradSampleModule(model)
    with pytest.raises(ConfigError, match="already wrapped"):
        dptrain.GradSampleModule(model)


def test_a_failed_backward_leaves_the_wrapper_usable() -> None:
    model = OutsideUse(also_inside=False)
    gsm = dptrain.GradSampleModule(model)
    with pytest.raises(UnsupportedModuleError):
        gsm(torch.randn(3, 2)).sum().backward()
    gsm.clear_per_sample()
    model.zero_grad()
    gsm(torch.randn(3, 2)).sum().backward(inputs=[model.fc.weight])  # scale.weight not asked for
    assert model.fc.weight.grad_sample.shape == (3, 2, 2)


def test_uses_of_a_linear_in_one_pass_reach_the_sampler_as_one_merged_call(monkeypatch) -> None:
    from dptrain.grad_sample import registry
    from dptrain.grad_sample.linear import linear_grad_sample

    class CountedLinear(nn.Linear):
        pass

    monkeypatch.setattr(registry, "GRAD_SAMPLERS", dict(registry.GRAD_SAMPLERS))
    seen = []

    @registry.register_grad_sampler(CountedLinear)
    def counted(layer, activations, backprops):
        seen.append(tuple(activations[0].shape))
        return linear_grad_sample(layer, activations, backprops)

    class ThreeSteps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = CountedLinear(3, 3, dtype=F64)

        def forward(self, x):
            h = x
            for _ in range(3):
                h = torch.tanh(self.cell(h))
            return h

    model = ThreeSteps()
    x = torch.randn(4, 3, dtype=F64)
    targets = torch.randn(4, 3, dtype=F64)
    assert_per_sample_exact(model, x, targets)
    assert seen == [(4, 3, 3)]  # one call: B=4, the 3 uses concatenated, 3 features


EMPTY_BATCH_LAYERS = {
    "linear": (lambda: nn.Linear(3, 2, dtype=F64), torch.randn(0, 3, dtype=F64)),
    "conv2d_reflect": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect", dtype=F64),
        torch.randn(0, 2, 5, 5, dtype=F64),
    ),
    "embedding": (lambda: nn.Embedding(5, 2, dtype=F64), torch.zeros(0, 3, dtype=torch.long)),
    "embedding_bag": (lambda: nn.EmbeddingBag(5, 2, dtype=F64), torch.zeros(0, 3, dtype=torch.long)),
    "layer_norm": (lambda: nn.LayerNorm(3, dtype=F64), torch.randn(0, 4, 3, dtype=F64)),
    "dp_lstm": (lambda: DPLSTM(3, 2, batch_first=True, dtype=F64), torch.randn(0, 4, 3, dtype=F64)),
}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("name", EMPTY_BATCH_LAYERS)
def test_empty_batch_gives_zero_rows_of_per_sample_gradients(name, reduction) -> None:
    """Poisson sampling yields empty batches; the unchanged training loop still runs them."""
    make, x = EMPTY_BATCH_LAYERS[name]
    layer = make()
    gsm = dptrain.GradSampleModule(layer, loss_reduction=reduction)
    out = gsm(x)
    out = out[0] if isinstance(out, tuple) else out
    (out.sum() if reduction == "sum" else out.mean()).backward()
    assert gsm.per_sample_batch_size() == 0
    for _, p in gsm.trainable_parameters():
        assert p.grad_sample.shape == (0, *p.shape)


def test_empty_pass_between_two_passes_adds_no_row() -> None:
    model = mlp()
    xs = [torch.randn(3, 4, dtype=F64), torch.zeros(0, 4, dtype=F64), torch.randn(2, 4, dtype=F64)]
    ts = [torch.randn(len(x), 2, dtype=F64) for x in xs]
    expected = microbatch_grad_samples(model, torch.cat(xs), torch.cat(ts), sum_of_outputs)
    gsm = dptrain.GradSampleModule(model, loss_reduction="sum")
    for x, t in zip(xs, ts):
        sum_of_outputs(gsm(x), t).backward()
    assert gsm.per_sample_batch_size() == 5
    for name, p in gsm.trainable_parameters():
        torch.testing.assert_close(p.grad_sample, expected[name])


def test_frozen_layer_is_neither_captured_nor_sampled(monkeypatch) -> None:
    from dptrain.grad_sample import registry
    from dptrain.grad_sample.linear import linear_grad_sample

    class SpiedLinear(nn.Linear):
        pass

    monkeypatch.setattr(registry, "GRAD_SAMPLERS", dict(registry.GRAD_SAMPLERS))
    sampled = []

    @registry.register_grad_sampler(SpiedLinear)
    def spied(layer, activations, backprops):
        sampled.append(layer)
        return linear_grad_sample(layer, activations, backprops)

    model = nn.Sequential(SpiedLinear(4, 3), nn.Tanh(), SpiedLinear(3, 2)).double()
    model[0].requires_grad_(False)
    gsm = dptrain.GradSampleModule(model)
    captured = []  # every forward call the wrapper records (it checks each one's batch size)
    record_call = gsm._check_output_batch

    def spy_capture(name, outputs):
        captured.append(name)
        return record_call(name, outputs)

    monkeypatch.setattr(gsm, "_check_output_batch", spy_capture)
    gsm(torch.randn(3, 4, dtype=F64)).sum().backward()
    assert captured == ["2"] and sampled == [model[2]]


def test_grad_sample_under_bf16_autocast_is_in_the_parameter_dtype() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3), nn.LayerNorm(3))
    gsm = dptrain.GradSampleModule(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gsm(torch.randn(4, 1, 4, 4))
    out.float().pow(2).mean().backward()
    assert {p.grad_sample.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("wrapper", ["hooks", "ghost_instantiate"])
def test_each_layer_input_is_released_as_soon_as_its_backward_is_processed(wrapper, monkeypatch) -> None:
    """Stored inputs must not live until the end of backward (the peak memory would then hold
    every activation at once, which plain autograd never does)."""
    import weakref

    import dptrain.grad_sample.module as module_mod
    from dptrain.grad_sample.ghost import GhostClippingModule

    stored: list[weakref.ref] = []
    real_detach = module_mod._detach

    def recording_detach(value):
        out = real_detach(value)
        if isinstance(out, torch.Tensor):  # (_detach recurses into tuples: each tensor once)
            stored.append(weakref.ref(out))
        return out

    monkeypatch.setattr(module_mod, "_detach", recording_detach)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    wrapped = dptrain.GradSampleModule(model) if wrapper == "hooks" else GhostClippingModule(model, strategy="instantiate")
    alive_at_first_layer: list[int] = []

    def count_alive_when_the_first_layer_gets_its_gradient(layer, args, out) -> None:
        out.register_hook(lambda grad: alive_at_first_layer.append(sum(r() is not None for r in stored)))

    model[0].register_forward_hook(count_alive_when_the_first_layer_gets_its_gradient)
    wrapped(torch.randn(5, 3)).sum().backward()
    assert len(stored) == 2
    assert alive_at_first_layer == [0]
