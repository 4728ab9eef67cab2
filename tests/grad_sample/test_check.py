"""dptrain.check_per_sample_gradients: the user-facing correctness check."""

import pytest
import torch
from torch import nn

import dptrain
from dptrain.errors import ConfigError, UnsupportedModuleError
from dptrain.grad_sample import registry
from dptrain.grad_sample.linear import linear_grad_sample

F64 = torch.float64


class DoubledLinear(nn.Linear):
    """A Linear subclass whose (deliberately wrong) sampler doubles the weight gradient."""


def test_check_returns_a_tiny_error_per_trainable_parameter() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)).double()
    model[2].bias.requires_grad_(False)
    errors = dptrain.check_per_sample_gradients(model, torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 1, 0]), nn.CrossEntropyLoss())
    assert list(errors) == ["0.weight", "0.bias", "2.weight"]
    assert max(errors.values()) < 1e-12


@pytest.fixture
def doubled_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "GRAD_SAMPLERS", dict(registry.GRAD_SAMPLERS))

    @registry.register_grad_sampler(DoubledLinear)
    def doubled(layer, activations, backprops):
        grads = linear_grad_sample(layer, activations, backprops)
        return {p: 2 * g if p is layer.weight else g for p, g in grads.items()}


def test_check_reports_the_error_of_a_wrong_sampler(doubled_sampler: None) -> None:
    model = DoubledLinear(3, 2, dtype=F64)
    x, y = torch.randn(4, 3, dtype=F64), torch.randn(4, 2, dtype=F64)
    errors = dptrain.check_per_sample_gradients(model, x, y, nn.MSELoss())
    assert errors["weight"] > 1e-3 and errors["bias"] < 1e-12


def test_check_leaves_the_model_unwrapped_and_without_gradients() -> None:
    model = nn.Linear(3, 2, dtype=F64)
    dptrain.check_per_sample_gradients(model, torch.randn(4, 3, dtype=F64), torch.randn(4, 2, dtype=F64), nn.MSELoss())
    assert model.weight.grad is None and getattr(model.weight, "grad_sample", None) is None
    assert not model._forward_hooks
    dptrain.GradSampleModule(model)  # can be wrapped again


def test_check_refuses_inputs_and_targets_with_different_batch_sizes() -> None:
    with pytest.raises(ConfigError, match=r"batch dimension differs.*targets"):
        dptrain.check_per_sample_gradients(nn.Linear(3, 2), torch.randn(4, 3), torch.randn(5, 2), nn.MSELoss())


def test_wrong_sampler_fails_the_first_backward_of_a_wrapped_model(doubled_sampler: None) -> None:
    gsm = dptrain.GradSampleModule(DoubledLinear(3, 2, dtype=F64))
    with pytest.raises(UnsupportedModuleError, match=r"\['weight'\] do not add up.*custom sampler"):
        gsm(torch.randn(4, 3, dtype=F64)).sum().backward()


def _summed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target, reduction="sum")


def test_check_of_a_plain_summing_function_takes_the_loss_reduction_argument() -> None:
    model = nn.Linear(3, 2, dtype=F64)
    x, y = torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 1, 0])
    errors = dptrain.check_per_sample_gradients(model, x, y, _summed_cross_entropy, loss_reduction="sum")
    assert max(errors.values()) < 1e-12


def test_check_refuses_a_loss_that_does_not_reduce_to_a_scalar() -> None:
    with pytest.raises(ConfigError, match=r"loss_fn.reduction is 'none'.*'mean' or 'sum'"):
        model, x, y = nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        dptrain.check_per_sample_gradients(model, x, y, nn.CrossEntropyLoss(reduction="none"))
