"""Opacus's ``opacus.optimizers``: DPOptimizer with Opacus's signature
``DPOptimizer(optimizer, *, noise_multiplier, max_grad_norm, expected_batch_size,
loss_reduction="mean", generator=None, secure_mode=False)`` over dptrain's DPOptimizer.

dptrain's optimizer clips through the module that computes the per-sample gradients: it is the
dptrain.opacus.grad_sample.GradSampleModule that owns the optimizer's parameters (or `module=`).
A DPOptimizer built by hand is accounted only by the hooks attached to it
(``attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate))``), as in Opacus.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from dptrain.opacus.grad_sample import owner_of
from dptrain.privacy.optimizer import DPOptimizer as CoreDPOptimizer


class DPOptimizer(CoreDPOptimizer):
    """dptrain's DPOptimizer built from Opacus's keywords (`generator` seeds the noise)."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: int, loss_reduction: str = "mean",
                 generator: torch.Generator | None = None, secure_mode: bool = False,
                 module: Any = None, sample_rate: float = 1.0, **kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        module = module if module is not None else owner_of(params)
        if module is None:
            raise ValueError("DPOptimizer: no per-sample gradient module owns the optimizer's "
                             "parameters. Wrap the model first: model = "
                             "dptrain.opacus.grad_sample.GradSampleModule(model) (or pass "
                             "module=), or use PrivacyEngine.make_private.")
        super().__init__(optimizer, noise_multiplier, max_grad_norm, expected_batch_size,
                         module=module, sample_rate=sample_rate, noise_generator=generator,
                         secure_mode=secure_mode)


__all__ = ["DPOptimizer"]
