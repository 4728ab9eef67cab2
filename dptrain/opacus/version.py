"""Opacus's ``opacus.version``: the Opacus version whose API dptrain.opacus follows."""

__version__ = "1.6.0"
