"""Opacus's ``opacus.accountants.accountant``: the accountant interface."""

from dptrain.opacus.accountants import IAccountant

__all__ = ["IAccountant"]
