"""Linear sampler: exact per-sample gradients for every input rank and layout."""

import pytest
import torch
from torch import nn

from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64


@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4), (5, 2, 3, 4)], ids=["2d", "3d", "4d"])
def test_linear_per_sample_gradients_match_recomputation_for_any_rank(shape, random_targets) -> None:
    layer = nn.Linear(4, 3, dtype=F64)
    x = torch.randn(shape, dtype=F64)
    assert_per_sample_exact(layer, x, random_targets(layer, x))


def test_linear_without_bias_gets_only_a_weight_grad_sample(random_targets) -> None:
    layer = nn.Linear(4, 3, bias=False, dtype=F64)
    x = torch.randn(5, 4, dtype=F64)
    assert_per_sample_exact(layer, x, random_targets(layer, x))


def test_linear_sequence_first_layout_with_batch_first_false(random_targets) -> None:
    layer = nn.Linear(4, 3, dtype=F64)
    x = torch.randn(6, 5, 4, dtype=F64)  # [T, B, D]
    targets = random_targets(layer, x).transpose(0, 1)  # targets are indexed by sample (dim 0)

    def loss(out, t):
        return (out.transpose(0, 1) * t).sum()

    loss.reduction = "sum"
    assert_per_sample_exact(layer, x, targets, loss, batch_first=False)


def test_linear_mean_reduced_loss_has_its_one_over_batch_undone() -> None:
    model = nn.Sequential(nn.Linear(4, 3, dtype=F64), nn.Tanh(), nn.Linear(3, 2, dtype=F64))
    x, y = torch.randn(5, 4, dtype=F64), torch.randn(5, 2, dtype=F64)
    assert_per_sample_exact(model, x, y, nn.MSELoss(reduction="mean"))


def test_linear_grad_sample_shape_is_batch_then_parameter_shape() -> None:
    import dptrain

    layer = nn.Linear(4, 3, dtype=F64)
    gsm = dptrain.GradSampleModule(layer)
    gsm(torch.randn(7, 2, 4, dtype=F64)).sum().backward()
    assert layer.weight.grad_sample.shape == (7, 3, 4)
    assert layer.bias.grad_sample.shape == (7, 3)
