"""A dispatch mode that tallies what the operations run inside it do (allocations, products)."""

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: measure(func, args, kwargs, out) -> the number one operation adds to the tally.
Measure = Callable[[Any, tuple, dict, Any], int]


def fresh_outputs(args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """The tensors of ``out`` that are new allocations (not views of the operation's inputs)."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]


class OpTally(TorchDispatchMode):
    """Sums ``measure(func, args, kwargs, out)`` over every operation run inside the mode."""

    def __init__(self, measure: Measure) -> None:
        super().__init__()
        self.measure = measure
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += self.measure(func, args, kwargs or {}, out)
        return out
