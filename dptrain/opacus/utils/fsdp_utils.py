"""Opacus's ``opacus.utils.fsdp_utils``: FSDP2Wrapper, which shards a model with FSDP2 the way
Opacus's FSDP path expects, here for dptrain's fully sharded DP-SGD (dptrain/distributed/fsdp.py).

``FSDP2Wrapper(model)`` applies ``fully_shard`` to each submodule holding parameters of its own
that dptrain computes per-sample gradients or norms for (a registered grad or norm sampler) or
that has no trainable parameter, then to the root (which takes every other parameter), all with
FSDP's default layout (each parameter's rows split over a 1-D mesh of all ranks): the layout
``make_private`` trains privately. ``make_private(..., grad_sample_mode="ghost_fsdp")`` is then
dptrain's ghost clipping of the sharded model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dptrain.grad_sample.registry import get_grad_sampler, get_norm_sampler


def has_params(module: nn.Module) -> bool:
    """Whether `module` holds parameters of its own (not counting its submodules')."""
    return len(list(module.parameters(recurse=False))) > 0


def iterate_submodules(module: nn.Module) -> Iterator[nn.Module]:
    """`module` and its descendants that hold parameters of their own, parents first."""
    if has_params(module):
        yield module
    for child in module.children():
        yield from iterate_submodules(child)


def _own_unit(module: nn.Module) -> bool:
    """Whether FSDP2Wrapper shards `module` as a unit of its own (Opacus's rule: a layer with a
    per-sample rule, or one without trainable parameters)."""
    trainable = any(p.requires_grad for p in module.parameters(recurse=False))
    return (get_grad_sampler(module) is not None or get_norm_sampler(module) is not None
            or not trainable)


def FSDP2Wrapper(model: nn.Module, **kwargs: Any) -> nn.Module:  # noqa: N802 (Opacus's name)
    """`model` sharded by ``fully_shard`` (see the module doc); keywords ``mp_policy`` (FSDP's
    MixedPrecisionPolicy, default none) and ``opacus_high_precision_layers`` (a tuple of layer
    classes kept in the default dtype, e.g. normalisation layers under a bf16 policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = kwargs.get("mp_policy", MixedPrecisionPolicy())
    high_precision = tuple(kwargs.get("opacus_high_precision_layers", ()))
    for module in list(iterate_submodules(model)):
        if not _own_unit(module):
            continue
        if high_precision and isinstance(module, high_precision):
            fully_shard(module, mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.get_default_dtype()))
        else:
            fully_shard(module, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


__all__ = ["FSDP2Wrapper", "has_params", "iterate_submodules"]
