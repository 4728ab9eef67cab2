"""Opacus's ``opacus.accountants.utils``: get_noise_multiplier, calibrated with dptrain's
search against the Opacus-shaped accountant (so RDP uses Opacus's default orders)."""

from __future__ import annotations

from dptrain.accounting.calibration import calibrate_sigma, steps_for
from dptrain.checks import check_delta, check_sample_rate


def get_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float,
                         epochs: int | None = None, steps: int | None = None,
                         accountant: str = "rdp", epsilon_tolerance: float = 0.01,
                         **kwargs: object) -> float:
    """Smallest sigma (within `epsilon_tolerance`) whose epsilon after `steps` (or `epochs` of
    1 / sample_rate steps) at `target_delta` is <= target_epsilon."""
    from dptrain.opacus.accountants import create_accountant

    q, delta = check_sample_rate(sample_rate), check_delta(target_delta)
    n = steps_for(q, steps, epochs)

    def epsilon(sigma: float) -> float:
        acc = create_accountant(accountant)
        acc.history = [(sigma, q, n)]
        return acc.get_epsilon(delta, **kwargs)

    return calibrate_sigma(epsilon, target_epsilon, epsilon_tolerance)


__all__ = ["get_noise_multiplier"]
