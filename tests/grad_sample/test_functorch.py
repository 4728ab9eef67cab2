"""The torch.func fallback for layers that own parameters but have no registered sampler."""

import pytest
import torch
from torch import nn

import dptrain
from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.registry import get_grad_sampler
from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64


class Bilinear(nn.Module):
    """y = (x W) * x + b, with W [D, D] and b [D] owned directly."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim, dtype=F64))
        self.bias = nn.Parameter(torch.randn(dim, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight) * x + self.bias


class GatedWithChild(nn.Module):
    """Owns ``gate`` directly and calls a child Linear (which keeps its own sampler)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(3, dtype=F64))
        self.fc = nn.Linear(3, 3, dtype=F64)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * torch.sigmoid(self.gate) * scale


class TwoHeads(nn.Module):
    """Returns a tuple of two outputs from directly owned parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(3, 2, dtype=F64))
        self.w2 = nn.Parameter(torch.randn(3, 4, dtype=F64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w1, torch.tanh(x @ self.w2)


class SumHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = TwoHeads()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.heads(x)
        return torch.cat([a, b], dim=-1)


def test_custom_layer_without_sampler_uses_the_exact_fallback(random_targets) -> None:
    assert get_grad_sampler(Bilinear) is None
    model = Bilinear(3)
    x = torch.randn(4, 2, 3, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


def test_fallback_holds_children_constant_and_accepts_keyword_inputs() -> None:
    model = GatedWithChild()
    x, g = torch.randn(4, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    gsm = dptrain.GradSampleModule(model, loss_reduction="sum")
    (gsm(x, scale=2.0) * g).sum().backward()
    for b in range(4):
        grads = torch.autograd.grad((model(x[b : b + 1], scale=2.0) * g[b]).sum(), [model.gate, model.fc.weight])
        torch.testing.assert_close(model.gate.grad_sample[b], grads[0])
        torch.testing.assert_close(model.fc.weight.grad_sample[b], grads[1])


def test_fallback_handles_a_layer_returning_a_tuple(random_targets) -> None:
    model = SumHeads()
    x = torch.randn(5, 3, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))


def test_fallback_handles_a_tuple_output_of_which_only_one_is_used() -> None:
    model = TwoHeads()
    x = torch.randn(3, 3, dtype=F64)
    gsm = dptrain.GradSampleModule(model, loss_reduction="sum")
    gsm(x)[0].sum().backward()
    assert model.w2.grad_sample.abs().max() == 0
    torch.testing.assert_close(model.w1.grad_sample, x.unsqueeze(-1).expand(3, 3, 2))


def test_fallback_in_sequence_first_layout(random_targets) -> None:
    model = Bilinear(3)
    x = torch.randn(5, 4, 3, dtype=F64)  # [T, B, D]
    targets = random_targets(model, x).transpose(0, 1)

    def loss(out, t):
        return (out.transpose(0, 1) * t).sum()

    loss.reduction = "sum"
    assert_per_sample_exact(model, x, targets, loss, batch_first=False)


class NoisyPositions(nn.Module):
    """Owns ``pos`` directly and applies dropout in its own forward (a ViT-like root module)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(2, 3, dtype=F64))
        self.fc = nn.Linear(3, 3, dtype=F64)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x) + self.pos)


def test_fallback_refuses_a_forward_with_randomness_naming_the_module_and_the_fix() -> None:
    gsm = dptrain.GradSampleModule(NoisyPositions())
    with pytest.raises(UnsupportedModuleError, match=r"model itself \(NoisyPositions\).*random.*own"):
        gsm(torch.randn(4, 2, 3, dtype=F64)).sum().backward()


def test_fallback_of_a_forward_with_randomness_is_exact_in_eval_of_its_dropout(random_targets) -> None:
    model = NoisyPositions()
    model.drop.eval()
    x = torch.randn(4, 2, 3, dtype=F64)
    assert_per_sample_exact(model, x, random_targets(model, x))
