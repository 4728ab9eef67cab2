"""A layer with a norm sampler but no clipped-sum rule (a user's own layer) in ghost mode: its
norms come from the registered norm sampler and its clipped sum from one reweighted backward of
the layer (dptrain.grad_sample.ghost_vjp), equal to the weighted sum of true per-sample grads."""

import copy

import pytest
import torch
from torch import nn

import dptrain
from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.ghost_vjp import vjp_clipped_sums
from tests.grad_sample.test_ghost_support import F64, REGIMES, TOL, assert_ghost_matches_hooks, sum_loss


class Gate(nn.Module):
    """``y = tanh(x) * scale + shift`` per feature on ``[B, T, d]`` (no built-in sampler)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.scale + self.shift


class NormedGate(Gate):
    """A Gate whose user registers a norm sampler (and nothing else) for ghost clipping."""


NORM_SAMPLER_CALLS: list[int] = []


@dptrain.register_norm_sampler(NormedGate)
def _normed_gate_norms(layer: NormedGate, activations: list[torch.Tensor], backprops: torch.Tensor) -> dict:
    """Squared norms over the sequence dim(s): ``[B, *, d]`` -> ``{scale: [B], shift: [B]}``."""
    NORM_SAMPLER_CALLS.append(backprops.shape[0])
    a, g = torch.tanh(activations[0]).flatten(1, -2), backprops.flatten(1, -2)
    return {layer.scale: (a * g).sum(dim=1).square().sum(dim=1), layer.shift: g.sum(dim=1).square().sum(dim=1)}


class Net(nn.Module):
    """Linear -> gate -> Linear on ``[B, T, 3]`` (or ``[T, B, 3]`` when sequence-first)."""

    def __init__(self, gate: type[Gate]) -> None:
        super().__init__()
        self.fc, self.gate, self.out = nn.Linear(3, 4), gate(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.fc(x)))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(5, 6, 3, dtype=F64, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("regime", REGIMES)
def test_user_norm_sampler_layer_takes_the_ghost_path_and_equals_hooks_mode(regime) -> None:
    NORM_SAMPLER_CALLS.clear()
    ghost = assert_ghost_matches_hooks(Net(NormedGate).double(), _inputs(), regime)
    assert ghost.layer_strategies()["gate"] == "ghost"
    assert NORM_SAMPLER_CALLS == [5]


def test_layer_without_any_sampler_is_instantiated_through_the_fallback() -> None:
    ghost = assert_ghost_matches_hooks(Net(Gate).double(), _inputs(), "mixed")
    assert ghost.layer_strategies()["gate"] == "instantiate"


def _batch_first_loss(batch_first: bool):
    """``sum(output * target)`` with ``target`` batch-first whatever the output's layout."""
    return sum_loss if batch_first else lambda output, target: sum_loss(output.transpose(0, 1), target)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_per_parameter_weights_give_each_parameter_its_own_weighted_sum(batch_first) -> None:
    model, loss = Net(NormedGate).double(), _batch_first_loss(batch_first)
    x = _inputs()[0] if batch_first else _inputs()[0].transpose(0, 1)
    target = torch.randn(5, 6, 2, dtype=F64)
    names = [n for n, _ in model.named_parameters()]
    weights = {n: torch.rand(5, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(names)}
    truth = microbatch_grad_samples(model, x, target, loss, batch_first=batch_first)
    ghost = GhostClippingModule(copy.deepcopy(model), batch_first=batch_first, loss_reduction="sum", strategy="ghost")
    loss(ghost(x), target).backward()
    params = dict(ghost.trainable_parameters())
    sums = ghost.weighted_sum({params[n]: w for n, w in weights.items()})
    for name in names:
        expected = torch.tensordot(weights[name], truth[name], dims=1)
        torch.testing.assert_close(sums[params[name]], expected, rtol=TOL, atol=TOL, msg=name)


def test_vjp_clipped_sums_of_a_linear_layer_equal_the_weighted_sum_of_its_per_sample_grads() -> None:
    layer = nn.Linear(3, 2).double()
    x, g = torch.randn(4, 5, 3, dtype=F64), torch.randn(4, 5, 2, dtype=F64)
    w = torch.rand(4, dtype=F64)
    sums = vjp_clipped_sums(layer, (x,), {}, 0, g, {layer.weight: w, layer.bias: 2 * w}, batch_dim=0)
    torch.testing.assert_close(sums[layer.weight], torch.einsum("b,btp,btd->pd", w, g, x), rtol=TOL, atol=TOL)
    torch.testing.assert_close(sums[layer.bias], torch.einsum("b,btp->p", 2 * w, g), rtol=TOL, atol=TOL)


def test_vjp_clipped_sums_leave_the_layer_parameters_without_grad() -> None:
    layer = nn.Linear(3, 2).double()
    x, g = torch.randn(4, 3, dtype=F64), torch.randn(4, 2, dtype=F64)
    vjp_clipped_sums(layer, (x,), {}, 0, g, {p: torch.ones(4, dtype=F64) for p in layer.parameters()}, batch_dim=0)
    assert all(p.grad is None for p in layer.parameters())


class NoisyNormedGate(NormedGate):
    """A NormedGate with dropout inside its forward: a re-run cannot reproduce the recorded call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(super().forward(x), p=0.5, training=self.training)


def test_a_re_run_that_draws_random_numbers_is_refused_naming_the_layer_and_the_fixes() -> None:
    ghost = GhostClippingModule(Net(NoisyNormedGate).double(), loss_reduction="sum", strategy="ghost")
    ghost(*_inputs()).sum().backward()
    with pytest.raises(UnsupportedModuleError, match="NoisyNormedGate.*random numbers.*register_clipped_sum"):
        ghost.weighted_sum({p: torch.ones(5, dtype=F64) for p in ghost.parameters()})


class TwiceNet(nn.Module):
    """One NormedGate applied twice, on different inputs: ``gate(fc(x)) + gate(2 * fc(x) + 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate, self.out = nn.Linear(3, 4), NormedGate(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out(self.gate(h) + self.gate(2 * h + 1))


@pytest.mark.parametrize("regime", REGIMES)
def test_user_norm_sampler_layer_used_twice_is_instantiated_from_each_use_own_inputs(regime) -> None:
    ghost = assert_ghost_matches_hooks(TwiceNet().double(), _inputs(), regime)
    assert ghost.layer_strategies()["gate"] == "instantiate"
