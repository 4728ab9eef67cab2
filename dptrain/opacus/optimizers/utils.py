"""Opacus's ``opacus.optimizers.utils``."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer


def params(optimizer: Optimizer) -> list[nn.Parameter]:
    """The parameters of `optimizer`'s groups that require a gradient (the ones DP-SGD clips and
    noises), in group order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


__all__ = ["params"]
