"""Opacus's ``opacus.accountants.prv``."""

from dptrain.opacus.accountants import PRVAccountant

__all__ = ["PRVAccountant"]
