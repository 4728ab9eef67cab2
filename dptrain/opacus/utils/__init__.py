"""Opacus's ``opacus.utils``."""
