"""Opacus's ``opacus.accountants.rdp``."""

from dptrain.opacus.accountants import RDPAccountant

__all__ = ["RDPAccountant"]
