"""Opacus's ``opacus.accountants.analysis.gdp`` on dptrain.accounting.gdp (the CLT mu of Poisson
subsampling; the uniform-sampling variants have no counterpart)."""

from __future__ import annotations

from dptrain.accounting.gdp import gdp_delta, gdp_epsilon, gdp_mu
from dptrain.opacus._absent import absent


def compute_mu_poisson(*, steps: int, noise_multiplier: float, sample_rate: float) -> float:
    """mu of `steps` Poisson-subsampled Gaussian steps (central limit theorem)."""
    return gdp_mu([(noise_multiplier, sample_rate, steps)])


def compute_eps_poisson(*, steps: int, noise_multiplier: float, sample_rate: float,
                        delta: float) -> float:
    """epsilon at `delta` of compute_mu_poisson's mu."""
    return gdp_epsilon(compute_mu_poisson(steps=steps, noise_multiplier=noise_multiplier,
                                          sample_rate=sample_rate), delta)


def delta_eps_mu(*, eps: float, mu: float) -> float:
    """delta(eps) of mu-GDP."""
    return gdp_delta(mu, eps)


def eps_from_mu(*, mu: float, delta: float) -> float:
    """The smallest epsilon of mu-GDP at `delta`."""
    return gdp_epsilon(mu, delta)


_UNIFORM = "compute_mu_poisson / compute_eps_poisson (dptrain samples batches by Poisson)"
compute_mu_uniform = absent("opacus.accountants.analysis.gdp.compute_mu_uniform", _UNIFORM)
compute_eps_uniform = absent("opacus.accountants.analysis.gdp.compute_eps_uniform", _UNIFORM)

__all__ = ["compute_eps_poisson", "compute_eps_uniform", "compute_mu_poisson",
           "compute_mu_uniform", "delta_eps_mu", "eps_from_mu"]
