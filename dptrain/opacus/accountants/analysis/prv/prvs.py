"""Opacus's ``opacus.accountants.analysis.prv.prvs``: internals of Opacus's PRV accountant that
dptrain's does not share (each raises when used)."""

from dptrain.opacus._absent import absent
from dptrain.opacus.accountants.analysis.prv._instead import INSTEAD

_HERE = "opacus.accountants.analysis.prv.prvs"
DiscretePRV = absent(f"{_HERE}.DiscretePRV", INSTEAD)
PoissonSubsampledGaussianPRV = absent(f"{_HERE}.PoissonSubsampledGaussianPRV", INSTEAD)
TruncatedPrivacyRandomVariable = absent(f"{_HERE}.TruncatedPrivacyRandomVariable", INSTEAD)
discretize = absent(f"{_HERE}.discretize", INSTEAD)

__all__ = ["DiscretePRV", "PoissonSubsampledGaussianPRV", "TruncatedPrivacyRandomVariable",
           "discretize"]
