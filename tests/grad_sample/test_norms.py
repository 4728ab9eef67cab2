"""LayerNorm, GroupNorm, InstanceNorm (affine) and RMSNorm samplers."""

import pytest
import torch
from torch import nn

from tests.grad_sample.conftest import assert_per_sample_exact

F64 = torch.float64

CONFIGS = {
    "layer_norm_last_dim": (lambda: nn.LayerNorm(4), (3, 5, 4)),
    "layer_norm_two_dims": (lambda: nn.LayerNorm((5, 4)), (3, 5, 4)),
    "layer_norm_no_bias": (lambda: nn.LayerNorm(4, bias=False), (3, 4)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5, 5)),
    "instance_norm_1d": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 3, 6)),
    "instance_norm_2d": (lambda: nn.InstanceNorm2d(3, affine=True), (3, 3, 4, 5)),
    "instance_norm_3d": (lambda: nn.InstanceNorm3d(2, affine=True), (3, 2, 3, 4, 3)),
    "rms_norm": (lambda: nn.RMSNorm(4), (3, 5, 4)),
    "rms_norm_explicit_eps": (lambda: nn.RMSNorm((5, 4), eps=1e-3), (3, 5, 4)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_norm_per_sample_gradients_match_recomputation(name, random_targets) -> None:
    make, shape = CONFIGS[name]
    layer = make().double()
    with torch.no_grad():  # non-trivial affine parameters
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(shape, dtype=F64) * 3 + 1
    assert_per_sample_exact(layer, x, random_targets(layer, x))
