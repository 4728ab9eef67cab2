"""Opacus's ``opacus.utils.module_utils``: the helpers user code calls to walk a model's
(trainable) modules and parameters and to compare state dicts."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Mapping

import torch
from torch import nn


def are_state_dict_equal(sd1: Mapping[str, Any], sd2: Mapping[str, Any]) -> bool:
    """True when both state dicts have the same keys and allclose tensors."""
    return len(sd1) == len(sd2) and all(
        k in sd2 and torch.allclose(v, sd2[k]) for k, v in sd1.items())


def has_trainable_params(module: nn.Module) -> bool:
    """Whether `module` holds a parameter of its own (not its submodules') that requires grad."""
    return any(p.requires_grad for p in module.parameters(recurse=False))


def requires_grad(module: nn.Module, *, recurse: bool = False) -> bool:
    """Whether any parameter of `module` (with recurse=True: of its submodules too) requires grad."""
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def parametrized_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, submodule) for `module` and its descendants that hold parameters of their own."""
    return ((name, m) for name, m in module.named_modules()
            if any(True for _ in m.parameters(recurse=False)))


def trainable_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, submodule) of parametrized_modules with a parameter of their own requiring grad."""
    return ((name, m) for name, m in parametrized_modules(module) if has_trainable_params(m))


def trainable_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of `module`'s parameters that require grad."""
    return ((name, p) for name, p in module.named_parameters() if p.requires_grad)


def clone_module(module: nn.Module) -> nn.Module:
    """An independent copy of `module` (its parameters and buffers copied)."""
    return copy.deepcopy(module)


def get_submodule(module: nn.Module, target: str) -> nn.Module:
    """The submodule of `module` at the dotted path `target` ("" is `module`); AttributeError
    naming the missing part otherwise (torch's Module.get_submodule)."""
    return module.get_submodule(target)


__all__ = ["are_state_dict_equal", "clone_module", "get_submodule", "has_trainable_params",
           "parametrized_modules", "requires_grad", "trainable_modules", "trainable_parameters"]
