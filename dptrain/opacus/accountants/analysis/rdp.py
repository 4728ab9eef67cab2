"""Opacus's ``opacus.accountants.analysis.rdp`` on dptrain.accounting.rdp: the RDP of `steps`
Poisson-subsampled Gaussian steps and its conversion to (epsilon, best order)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dptrain.accounting.rdp import rdp_sampled_gaussian, rdp_to_epsilon


def compute_rdp(*, q: float, noise_multiplier: float, steps: int,
                orders: float | Sequence[float]) -> np.ndarray:
    """RDP (nats) at each of `orders` of `steps` steps at sample rate q, shape [len(orders)]."""
    return steps * rdp_sampled_gaussian(q, noise_multiplier, np.atleast_1d(orders).tolist())


def get_privacy_spent(*, orders: float | Sequence[float], rdp: float | Sequence[float],
                      delta: float) -> tuple[float, float]:
    """(epsilon, the order that gives it) of the RDP curve `rdp` at `delta` (the tight
    conversion Opacus uses)."""
    return rdp_to_epsilon(np.atleast_1d(rdp), np.atleast_1d(orders).tolist(), delta)


__all__ = ["compute_rdp", "get_privacy_spent"]
