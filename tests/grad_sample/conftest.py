"""Shared assertion for the grad_sample tests: engine vs micro-batch ground truth (check.py)."""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from dptrain.grad_sample.check import check_per_sample_gradients

TOL = 1e-10


def sum_of_outputs(output: Tensor, target: Tensor) -> Tensor:
    """A loss that weights every output entry by a fixed target of the same shape (sum reduction)."""
    return (output * target).sum()


sum_of_outputs.reduction = "sum"


def assert_per_sample_exact(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    targets: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = sum_of_outputs,
    batch_first: bool = True,
) -> None:
    """Assert every trainable parameter's per-sample gradient matches recomputation (float64)."""
    errors = check_per_sample_gradients(model, inputs, targets, loss_fn, batch_first=batch_first)
    assert errors, "model has no trainable parameter"
    worst = {n: e for n, e in errors.items() if not e <= TOL}
    assert not worst, f"per-sample gradients differ from micro-batch recomputation: {worst}"


@pytest.fixture
def random_targets() -> Callable[[nn.Module, Tensor], Tensor]:
    """targets shaped like the model's output on ``x`` (for :func:`sum_of_outputs`)."""

    def make(model: nn.Module, *inputs: Tensor) -> Tensor:
        with torch.no_grad():
            return torch.randn_like(model(*inputs))

    return make
