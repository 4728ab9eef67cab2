"""Opacus's ``opacus.validators``."""

from dptrain.opacus.validators.module_validator import ModuleValidator

__all__ = ["ModuleValidator"]
