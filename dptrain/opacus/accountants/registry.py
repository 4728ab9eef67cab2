"""Opacus's ``opacus.accountants.registry``: the mechanism -> accountant class table."""

from dptrain.opacus.accountants import _ACCOUNTANTS, create_accountant, register_accountant

__all__ = ["_ACCOUNTANTS", "create_accountant", "register_accountant"]
