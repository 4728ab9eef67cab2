"""Opacus's ``ModuleValidator`` (VALIDATORS / FIXERS per module type, validate(strict=...),
fix(**kwargs)) over dptrain.validation's rules, which stay the one home of what is refused and
how it is replaced (dptrain also refuses a frozen BatchNorm: its running statistics leak)."""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

from torch import nn

from dptrain.opacus.validators.errors import (IllegalModuleConfigurationError,
                                              ShouldReplaceModuleError, UnsupportedModuleError)
from dptrain.validation import ModuleValidator as CoreValidator

logger = logging.getLogger(__name__)

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCENORM = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_TYPES = (*_BATCHNORM, *_INSTANCENORM.values(), nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell,
          nn.GRUCell, nn.RNNCell, nn.MultiheadAttention)


def _validate(module: nn.Module) -> list[UnsupportedModuleError]:
    """dptrain's problem with `module` itself, as Opacus's error list."""
    problem = CoreValidator.problem_of(module)
    if problem is None:
        return []
    # a module to configure differently (running stats off) vs one to replace (Opacus's kinds)
    kind = (IllegalModuleConfigurationError if isinstance(module, tuple(_INSTANCENORM.values()))
            else ShouldReplaceModuleError)
    return [kind(f"{problem.problem} Fix: {problem.fix}")]


def _fix(module: nn.Module, **kwargs: Any) -> nn.Module:
    """dptrain's replacement of `module` (weights kept)."""
    return CoreValidator.replacement_of(module)


def _fix_batchnorm(module: nn.Module, replace_bn_with_in: bool = False,
                   num_groups: int | None = None, **kwargs: Any) -> nn.Module:
    """Opacus's BatchNorm fixer: GroupNorm(num_groups or gcd(32, C), C), or InstanceNorm with
    replace_bn_with_in=True (affine weights kept in both)."""
    if replace_bn_with_in and num_groups is not None:
        raise ValueError("is_replace_bn_with_in and num_groups are mutually exclusive")
    if not replace_bn_with_in and num_groups is None:
        return _fix(module)
    c = module.num_features
    if replace_bn_with_in:
        dim = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}.get(type(module), 2)
        new = _INSTANCENORM[dim](c, affine=module.affine)
    else:
        new = nn.GroupNorm(num_groups, c, affine=module.affine)
    if module.affine:
        new.load_state_dict({"weight": module.weight.detach(), "bias": module.bias.detach()})
    return new.to(module.weight.device if module.affine else "cpu")


class ModuleValidator:
    """Opacus's ModuleValidator: per-type VALIDATORS and FIXERS (register your own there)."""

    VALIDATORS: dict[type, Callable[[nn.Module], list[UnsupportedModuleError]]] = {
        t: _validate for t in _TYPES}
    FIXERS: dict[type, Callable[..., nn.Module]] = {
        **{t: _fix for t in _TYPES}, **{t: _fix_batchnorm for t in _BATCHNORM}}

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[UnsupportedModuleError]:
        """The errors of `module` (a model in eval mode; each registered validator's); with
        strict=True they are raised as one UnsupportedModuleError."""
        errors: list[UnsupportedModuleError] = []
        if not module.training:
            errors.append(IllegalModuleConfigurationError("Model needs to be in training mode"))
        for _, sub in module.named_modules():
            if type(sub) in cls.VALIDATORS:
                errors.extend(cls.VALIDATORS[type(sub)](sub))
        if strict and errors:
            raise UnsupportedModuleError(errors)
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        return not cls.validate(module, strict=False)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        """A copy of `module` with every submodule of a registered type replaced by its fixer
        (kwargs, e.g. num_groups= or replace_bn_with_in=True, go to the fixers)."""
        module = copy.deepcopy(module)
        if type(module) in cls.FIXERS:
            return cls.FIXERS[type(module)](module, **kwargs)
        for name, sub in list(module.named_modules()):
            if name and type(sub) in cls.FIXERS:
                parent_name, _, child = name.rpartition(".")
                parent = module.get_submodule(parent_name)
                if getattr(parent, child, None) is sub:
                    new = cls.FIXERS[type(sub)](sub, **kwargs)
                    setattr(parent, child, new)
                    logger.info("Replaced sub_module %s : %s with %s", name, sub, new)
        return module

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed

    # dptrain's own checks, for code that mixes both
    raise_if_invalid = staticmethod(CoreValidator.raise_if_invalid)


__all__ = ["ModuleValidator"]
