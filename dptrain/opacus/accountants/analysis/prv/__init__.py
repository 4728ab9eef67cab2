"""Opacus's ``opacus.accountants.analysis.prv``: Opacus's PRV internals, which have no
counterpart in dptrain (see the submodules)."""

from dptrain.opacus.accountants.analysis.prv.compose import compose_heterogeneous
from dptrain.opacus.accountants.analysis.prv.domain import Domain, compute_safe_domain_size
from dptrain.opacus.accountants.analysis.prv.prvs import (DiscretePRV,
                                                         PoissonSubsampledGaussianPRV,
                                                         TruncatedPrivacyRandomVariable,
                                                         discretize)

__all__ = ["DiscretePRV", "Domain", "PoissonSubsampledGaussianPRV",
           "TruncatedPrivacyRandomVariable", "compose_heterogeneous", "compute_safe_domain_size",
           "discretize"]
