"""Opacus's validation errors (``opacus.validators.errors``); all are dptrain's
UnsupportedModuleError, so ``except dptrain.errors.UnsupportedModuleError`` catches them too."""

from dptrain.errors import UnsupportedModuleError


class UnsupportedError(UnsupportedModuleError):
    """Base of Opacus's validation errors."""


class UnsupportableModuleError(UnsupportedModuleError):
    """A module that cannot be made private."""


class NotYetSupportedModuleError(UnsupportedModuleError):
    """A module without per-sample gradients yet."""


class ShouldReplaceModuleError(UnsupportedModuleError):
    """A module to replace by its private equivalent (ModuleValidator.fix does it)."""


class IllegalModuleConfigurationError(UnsupportedModuleError):
    """A module configured in a way DP training refuses (a model in eval mode, running stats)."""
