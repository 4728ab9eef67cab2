"""Ghost rules of convolutions: the patch Gram without unfolding, chunked computation, the cost
rule per device, and float32 Gram bounds."""

import pytest
import torch
from torch import nn

from dptrain.grad_sample import workspace
from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.grad_sample.conv import conv_weight_grad_samples, prefers_grouped_kernel
from dptrain.grad_sample.ghost_conv import (
    _flat,
    conv_clipped_sum,
    conv_norms,
    conv_prefers_ghost,
    grouped_patches,
    pixel_patch_gram,
)
from tests.grad_sample.test_conv import CONFIGS
from tests.grad_sample.test_ghost_support import F64, TOL, sum_loss


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    cls, kwargs, shape = CONFIGS[name]
    layer = cls(**kwargs, dtype=F64)
    x = torch.randn(shape, dtype=F64)
    return layer, x, torch.randn_like(layer(x))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", CONFIGS)
def test_patch_gram_from_pixel_products_equals_gram_of_unfolded_patches(name) -> None:
    layer, x, _ = _case(name)
    patches = _flat(grouped_patches(layer, x))
    expected = patches @ patches.transpose(1, 2)
    torch.testing.assert_close(pixel_patch_gram(layer, x, F64), expected, rtol=TOL, atol=TOL)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", CONFIGS)
def test_conv_norms_and_clipped_sums_over_chunks_of_samples_equal_one_call(name, monkeypatch) -> None:
    layer, x, target = _case(name)
    weights = {p: torch.rand(x.shape[0], dtype=F64) for p in layer.parameters()}
    whole = conv_norms(layer, [x], target), conv_clipped_sum(layer, [x], target, weights)
    grads = conv_weight_grad_samples(layer, x, target)
    monkeypatch.setattr(workspace, "MIN_WORKSPACE", 1)  # the tiny inputs' budget: one sample per chunk
    assert len(workspace.sample_chunks(x.shape[0], x[0].numel() * 100, x.numel())) == x.shape[0]
    chunked = conv_norms(layer, [x], target), conv_clipped_sum(layer, [x], target, weights)
    for one, other in zip(whole, chunked):
        for p in layer.parameters():
            torch.testing.assert_close(other[p], one[p], rtol=TOL, atol=TOL)
    torch.testing.assert_close(conv_weight_grad_samples(layer, x, target), grads, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_conv_clipped_sum_is_float32_and_outside_the_autograd_graph(dtype) -> None:
    layer = nn.Conv1d(2, 3, 3, padding=1).to(dtype)
    x, target = torch.randn(4, 2, 6).to(dtype), torch.randn(4, 3, 6).to(dtype)
    sums = conv_clipped_sum(layer, [x], target, {p: torch.rand(4) for p in layer.parameters()})
    assert all(s.dtype == torch.float32 and not s.requires_grad for s in sums.values())


def test_conv_norms_of_an_empty_batch_are_empty() -> None:
    layer = nn.Conv2d(2, 3, 3, padding=1)
    norms = conv_norms(layer, [torch.zeros(0, 2, 5, 5)], torch.zeros(0, 3, 5, 5))
    assert all(n.shape == (0,) for n in norms.values())


def test_sample_chunks_cover_the_batch_within_the_budget() -> None:
    chunks = workspace.sample_chunks(10, workspace.MIN_WORKSPACE // 3, 0)
    assert chunks == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert workspace.sample_chunks(10, 1, 0) == [slice(0, 10)]
    assert workspace.sample_chunks(0, 1, 0) == [slice(0, 0)]


# (C_in, C_out, input size, kernel, stride, padding, ghost on CPU)
PAPER_CONVS = [
    (3, 32, 32, 3, 1, 1, False), (32, 32, 32, 3, 1, 1, False), (32, 64, 16, 3, 1, 1, False),
    (64, 64, 16, 3, 1, 1, False), (64, 128, 8, 3, 1, 1, True), (128, 128, 8, 3, 1, 1, True),
    (128, 256, 4, 3, 1, 1, True), (256, 10, 4, 3, 1, 1, True),  # cifar10_cnn
    (1, 16, 28, 8, 2, 3, False), (16, 32, 13, 4, 2, 0, False),  # mnist_cnn
]


@pytest.mark.parametrize(("c_in", "c_out", "size", "kernel", "stride", "padding", "ghost"), PAPER_CONVS)
def test_conv_cost_rule_on_cpu_follows_the_measured_choices(c_in, c_out, size, kernel, stride, padding, ghost) -> None:
    layer = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    x = torch.zeros(1, c_in, size, size)
    assert conv_prefers_ghost(layer, [x], layer(x).detach()) is ghost


def test_off_the_cpu_ghost_is_taken_up_to_twice_the_instantiation_cost() -> None:
    # (64 -> 64 on 16x16: ghost costs 1.16x instantiation's multiply-adds; instantiated on CPU)
    layer = nn.Conv2d(64, 64, 3, padding=1, device="meta")
    x = torch.zeros(1, 64, 16, 16, device="meta")
    assert conv_prefers_ghost(layer, [x], torch.zeros(1, 64, 16, 16, device="meta"))


def test_off_the_cpu_per_sample_conv_gradients_take_the_unfold_kernel() -> None:
    layer = nn.Conv2d(32, 32, 3, padding=1)
    assert prefers_grouped_kernel(layer, torch.zeros(1, 32, 32, 32))
    assert not prefers_grouped_kernel(layer, torch.zeros(1, 32, 32, 32, device="meta"))


def test_float32_conv_norms_are_upper_bounds_within_the_gram_tolerance() -> None:
    from dptrain.grad_sample.ghost_math import GRAM_SLACK_TOLERANCE

    layer, x = nn.Conv2d(8, 16, 3, padding=1), torch.randn(6, 8, 8, 8)
    target = torch.randn_like(layer(x))
    truth = microbatch_grad_samples(layer.double(), x.double(), target.double(), sum_loss)
    norms = conv_norms(layer.float(), [x], target)
    for name, p in layer.named_parameters():
        exact = truth[name].flatten(1).square().sum(dim=1)
        ratio = norms[p].double() / exact
        assert bool((ratio >= 1 - 1e-12).all()), name  # exact up to the float64 reference's rounding
        assert bool((ratio <= 1 + GRAM_SLACK_TOLERANCE + 1e-6).all()), name
