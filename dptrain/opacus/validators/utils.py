"""Opacus's ``opacus.validators.utils``: the decorators that register a validator or a fixer
for module types in ModuleValidator's tables (the last registration for a type wins)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from torch import nn

from dptrain.opacus.validators.module_validator import ModuleValidator

Types = type[nn.Module] | Sequence[type[nn.Module]]


def _register(table: dict, target_class_or_classes: Types) -> Callable[[Callable], Callable]:
    """A decorator that puts its function in `table` for each of the given types."""
    classes = (target_class_or_classes if isinstance(target_class_or_classes, Sequence)
               else [target_class_or_classes])

    def decorator(f: Callable) -> Callable:
        for cls in classes:
            table[cls] = f
        return f
    return decorator


def register_module_validator(target_class_or_classes: Types,
                              validator_class: type = ModuleValidator
                              ) -> Callable[[Callable], Callable]:
    """Register the decorated f(module) -> list of errors as the validator of these types."""
    return _register(validator_class.VALIDATORS, target_class_or_classes)


def register_module_fixer(target_class_or_classes: Types,
                          validator_class: type = ModuleValidator
                          ) -> Callable[[Callable], Callable]:
    """Register the decorated f(module, **kwargs) -> replacement module as the fixer of these
    types (ModuleValidator.fix calls it)."""
    return _register(validator_class.FIXERS, target_class_or_classes)


__all__ = ["register_module_fixer", "register_module_validator"]
