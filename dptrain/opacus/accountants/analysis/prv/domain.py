"""Opacus's ``opacus.accountants.analysis.prv.domain``: internals of Opacus's PRV accountant
that dptrain's does not share (each raises when used)."""

from dptrain.opacus._absent import absent
from dptrain.opacus.accountants.analysis.prv._instead import INSTEAD

_HERE = "opacus.accountants.analysis.prv.domain"
Domain = absent(f"{_HERE}.Domain", INSTEAD)
compute_safe_domain_size = absent(f"{_HERE}.compute_safe_domain_size", INSTEAD)

__all__ = ["Domain", "compute_safe_domain_size"]
