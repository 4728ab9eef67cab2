"""Opacus's ``opacus.grad_sample.functorch.make_functional``: a module as a function of its
parameters (torch.func.functional_call over a parameter-free copy), the helper Opacus's examples
use to compute per-sample gradients by hand with torch.func.vmap."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain.opacus._absent import absent


def make_functional(mod: nn.Module, disable_autograd_tracking: bool = False
                    ) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """(fmodel, params): fmodel(params, *args, **kwargs) is mod(*args, **kwargs) computed with
    `params` (a tuple in mod.named_parameters() order) in place of mod's own; `params` are mod's
    parameters (detached with disable_autograd_tracking=True)."""
    named = dict(mod.named_parameters())
    names, values = tuple(named), tuple(named.values())
    stateless = copy.deepcopy(mod).to("meta")

    def fmodel(new_values: tuple[torch.Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(stateless, dict(zip(names, new_values)), args, kwargs)

    if disable_autograd_tracking:
        values = tuple(v.detach() for v in values)
    return fmodel, values


_OWN_RULES = ("GradSampleModule(model): dptrain computes the per-sample gradients of a layer "
              "without a registered rule itself (dptrain.grad_sample.functorch)")
prepare_layer = absent("opacus.grad_sample.functorch.prepare_layer", _OWN_RULES)
ft_compute_per_sample_gradient = absent("opacus.grad_sample.functorch.ft_compute_per_sample_gradient",
                                        _OWN_RULES)

__all__ = ["ft_compute_per_sample_gradient", "make_functional", "prepare_layer"]
