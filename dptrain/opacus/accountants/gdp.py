"""Opacus's ``opacus.accountants.gdp``."""

from dptrain.opacus.accountants import GaussianAccountant

__all__ = ["GaussianAccountant"]
