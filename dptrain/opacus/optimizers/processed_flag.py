"""Opacus's processed flag (``opacus.optimizers.optimizer._mark_as_processed`` /
``_check_processed_flag``): a mark on a tensor a step has used, which DPOptimizer subclasses
written for Opacus check in their ``add_noise``."""

from __future__ import annotations

from typing import Union

import torch

Tensors = Union[torch.Tensor, list[torch.Tensor]]


def _mark_as_processed(obj: Tensors) -> None:
    """Mark `obj` (a tensor, or each tensor of a list) as used by an optimizer step."""
    for x in [obj] if isinstance(obj, torch.Tensor) else obj:
        x._processed = True


def _check_processed_flag(obj: Tensors) -> None:
    """ValueError when `obj` (a tensor, or a tensor of a list) was already used by a step (Opacus's
    check that zero_grad() ran between steps; dptrain's step clears p.summed_grad itself)."""
    for x in [obj] if isinstance(obj, torch.Tensor) else obj:
        if hasattr(x, "_processed"):
            raise ValueError("Gradients haven't been cleared since the last optimizer step. In "
                             "order to obtain privacy guarantees you must call "
                             "optimizer.zero_grad() on each step.")
