"""Opacus's ``opacus.validators.lstm``: validate(module) -> the list of its errors, fix(module)
-> its replacement (dptrain.validation's rule for the layer, through ModuleValidator)."""

from dptrain.opacus.validators.module_validator import _validate as validate
from dptrain.opacus.validators.module_validator import _fix as fix

__all__ = ["fix", "validate"]
