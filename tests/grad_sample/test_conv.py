"""Conv1d/2d/3d sampler: exact for stride, padding (incl. "same"), dilation, groups, padding modes."""

import pytest
import torch
from torch import nn

from dptrain.grad_sample.check import microbatch_grad_samples
from dptrain.grad_sample.conv import conv_weight_grad_samples, prefers_grouped_kernel, weight_grad_kernel_for
from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64

CONFIGS = {
    "conv1d_plain": (nn.Conv1d, dict(in_channels=2, out_channels=3, kernel_size=3), (3, 2, 9)),
    "conv1d_same_reflect_dilated": (
        nn.Conv1d,
        dict(in_channels=2, out_channels=4, kernel_size=3, padding="same", dilation=2, padding_mode="reflect"),
        (3, 2, 10),
    ),
    "conv2d_stride_padding": (nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1), (3, 2, 7, 6)),
    "conv2d_groups_dilation": (
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=(2, 3), dilation=(2, 1), groups=2),
        (3, 4, 7, 6),
    ),
    "conv2d_depthwise_circular": (
        nn.Conv2d,
        dict(in_channels=3, out_channels=3, kernel_size=3, padding=1, groups=3, padding_mode="circular"),
        (3, 3, 5, 5),
    ),
    "conv2d_replicate_no_bias": (
        nn.Conv2d,
        dict(in_channels=2, out_channels=3, kernel_size=3, padding=(1, 2), padding_mode="replicate", bias=False),
        (3, 2, 5, 5),
    ),
    "conv2d_same_even_kernel": (nn.Conv2d, dict(in_channels=2, out_channels=2, kernel_size=4, padding="same"), (2, 2, 6, 6)),
    "conv3d_stride_groups": (
        nn.Conv3d,
        dict(in_channels=2, out_channels=4, kernel_size=(2, 3, 2), stride=(1, 2, 1), padding=1, groups=2),
        (2, 2, 4, 5, 4),
    ),
    "conv3d_valid": (nn.Conv3d, dict(in_channels=1, out_channels=2, kernel_size=2, padding="valid"), (2, 1, 3, 3, 3)),
    "conv2d_one_channel_stride_padding": (
        nn.Conv2d, dict(in_channels=1, out_channels=3, kernel_size=4, stride=2, padding=1), (3, 1, 9, 8)
    ),
    "conv1d_one_channel_strided_dilated_uneven": (  # the last input row is never reached by the stride
        nn.Conv1d, dict(in_channels=1, out_channels=2, kernel_size=3, stride=3, dilation=2), (3, 1, 12)
    ),
}
#: Configurations with one input channel per group: the direct kernel applies.
ONE_CHANNEL_PER_GROUP = [name for name, (_, kwargs, _) in CONFIGS.items() if kwargs["in_channels"] == kwargs.get("groups", 1)]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", CONFIGS)
def test_conv_per_sample_gradients_match_recomputation(name, random_targets) -> None:
    cls, kwargs, shape = CONFIGS[name]
    layer = cls(**kwargs, dtype=F64)
    x = torch.randn(shape, dtype=F64)
    assert_per_sample_exact(layer, x, random_targets(layer, x))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(
    ("name", "kernel"),
    [(name, kernel) for name in CONFIGS for kernel in ("grouped", "unfold")]
    + [(name, "direct") for name in ONE_CHANNEL_PER_GROUP],
)
def test_every_weight_gradient_kernel_matches_recomputation(name, kernel) -> None:
    cls, kwargs, shape = CONFIGS[name]
    layer = cls(**kwargs, dtype=F64)
    x = torch.randn(shape, dtype=F64)
    target = torch.randn_like(layer(x))
    truth = microbatch_grad_samples(layer, x, target, lambda out, t: (out * t).sum())
    got = conv_weight_grad_samples(layer, x, target, kernel=kernel)
    torch.testing.assert_close(got, truth["weight"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("in_channels", "out_channels", "size", "grouped"),
    [(32, 32, 32, True), (64, 64, 16, True), (256, 10, 4, True), (16, 32, 5, True), (128, 256, 4, False), (64, 128, 8, False)],
)
def test_kernel_choice_follows_the_measured_rule(in_channels, out_channels, size, grouped) -> None:
    layer = nn.Conv2d(in_channels, out_channels, 3, padding=1)
    assert prefers_grouped_kernel(layer, torch.zeros(1, out_channels, size, size)) is grouped


def test_single_channel_convolutions_take_the_direct_kernel_on_cpu() -> None:
    layer = nn.Conv2d(1, 16, 8, stride=2, padding=3)  # mnist_cnn's first layer
    assert weight_grad_kernel_for(layer, torch.zeros(1, 16, 14, 14)) == "direct"
    assert weight_grad_kernel_for(layer, torch.zeros(1, 16, 14, 14, device="meta")) == "unfold"
    assert weight_grad_kernel_for(nn.Conv2d(16, 32, 4, stride=2), torch.zeros(1, 32, 5, 5)) == "grouped"


def test_the_direct_kernel_refuses_several_input_channels_per_group() -> None:
    layer = nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 2, 5, 5)
    with pytest.raises(ValueError, match="one input channel per group"):
        conv_weight_grad_samples(layer, x, torch.randn_like(layer(x)), kernel="direct")


def test_conv_inside_a_cnn_with_mean_reduced_cross_entropy() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)
    ).double()
    x, y = torch.randn(4, 1, 6, 6, dtype=F64), torch.tensor([0, 2, 1, 2])
    assert_per_sample_exact(model, x, y, nn.CrossEntropyLoss())


CONV_DIMS = {1: (nn.Conv1d, (2, 2, 9)), 2: (nn.Conv2d, (2, 2, 6, 7)), 3: (nn.Conv3d, (2, 2, 5, 4, 5))}


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("dims", CONV_DIMS, ids=lambda d: f"conv{d}d")
def test_every_padding_mode_in_every_dimension_with_stride_and_dilation(
    dims, padding_mode, random_targets
) -> None:
    cls, shape = CONV_DIMS[dims]
    layer = cls(
        2, 4, kernel_size=3, stride=2, padding=2, dilation=2, groups=2, padding_mode=padding_mode, dtype=F64
    )
    x = torch.randn(shape, dtype=F64)
    assert_per_sample_exact(layer, x, random_targets(layer, x))
