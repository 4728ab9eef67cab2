"""Opacus's ``opacus.accountants.analysis.prv.compose``: an internal of Opacus's PRV accountant
that dptrain's does not share (it raises when used)."""

from dptrain.opacus._absent import absent
from dptrain.opacus.accountants.analysis.prv._instead import INSTEAD

compose_heterogeneous = absent("opacus.accountants.analysis.prv.compose.compose_heterogeneous",
                               INSTEAD)

__all__ = ["compose_heterogeneous"]
