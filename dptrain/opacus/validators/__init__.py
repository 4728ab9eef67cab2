"""Opacus's ``opacus.validators``."""

from dptrain.opacus.validators.module_validator import ModuleValidator
from dptrain.opacus.validators.utils import register_module_fixer, register_module_validator

__all__ = ["ModuleValidator", "register_module_fixer", "register_module_validator"]
