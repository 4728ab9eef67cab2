"""Opacus's ``opacus.optimizers``: DPOptimizer and DistributedDPOptimizer with Opacus's signature
``DPOptimizer(optimizer, *, noise_multiplier, max_grad_norm, expected_batch_size,
loss_reduction="mean", generator=None, secure_mode=False)`` over dptrain's optimizers.

dptrain's optimizer clips through the module that computes the per-sample gradients: it is the
dptrain.opacus.grad_sample.GradSampleModule that owns the optimizer's parameters (or `module=`).
A DPOptimizer built by hand is accounted only by the hooks attached to it
(``attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate))``), as in Opacus.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from dptrain.distributed.runtime import get_world_size
from dptrain.opacus.grad_sample import owner_of
from dptrain.privacy.distributed import DistributedDPOptimizer as CoreDistributedDPOptimizer
from dptrain.privacy.optimizer import DPOptimizer as CoreDPOptimizer


def _owning_module(optimizer: Optimizer, module: Any, name: str) -> Any:
    """`module`, or the GradSampleModule owning `optimizer`'s parameters (ValueError if none)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    module = module if module is not None else owner_of(params)
    if module is None:
        raise ValueError(f"{name}: no per-sample gradient module owns the optimizer's "
                         "parameters. Wrap the model first: model = "
                         "dptrain.opacus.grad_sample.GradSampleModule(model) (or pass "
                         "module=), or use PrivacyEngine.make_private.")
    return module


class DPOptimizer(CoreDPOptimizer):
    """dptrain's DPOptimizer built from Opacus's keywords (`generator` seeds the noise)."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: int, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False,
                 module: Any = None, sample_rate: float = 1.0, **kwargs: Any) -> None:
        super().__init__(optimizer, noise_multiplier, max_grad_norm, expected_batch_size,
                         module=_owning_module(optimizer, module, "DPOptimizer"),
                         sample_rate=sample_rate, noise_generator=generator,
                         secure_mode=secure_mode)


class DistributedDPOptimizer(CoreDistributedDPOptimizer):
    """dptrain's DistributedDPOptimizer built from Opacus's keywords, over the default group.

    As in Opacus, `expected_batch_size` is one rank's expected batch: the step writes
    p.grad = (S + Z) / (expected_batch_size * W), S the clipped sums of all W ranks and Z the
    noise drawn once, by rank 0 (what Opacus's mean of the ranks' (S_r + Z_r) / B_r gives).
    `optimizer.expected_batch_size` then holds dptrain's global expected batch, W times it.
    Building it is a collective (the ranks check they apply the same mechanism).
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: int, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False,
                 module: Any = None, sample_rate: float = 1.0, **kwargs: Any) -> None:
        super().__init__(optimizer, noise_multiplier, max_grad_norm,
                         expected_batch_size * get_world_size(),
                         module=_owning_module(optimizer, module, "DistributedDPOptimizer"),
                         sample_rate=sample_rate, noise_generator=generator,
                         secure_mode=secure_mode)


__all__ = ["DPOptimizer", "DistributedDPOptimizer"]
