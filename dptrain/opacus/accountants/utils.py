"""Opacus's ``opacus.accountants.utils``: get_noise_multiplier, Opacus's own bisection (the same
bracket, the same midpoints, the same stopping rule) run against the Opacus-shaped accountant of
dptrain.opacus.accountants (so RDP uses Opacus's default orders). Being the same search, it
returns Opacus's sigma wherever the accountant gives Opacus's epsilons; dptrain's own calibration
(dptrain.accounting.calibration) finds a smaller sigma within the same tolerance."""

from __future__ import annotations

from dptrain.checks import check_delta, check_sample_rate, check_steps
from dptrain.errors import PrivacyError

#: the largest sigma Opacus's search tries before giving up
MAX_SIGMA = 1e6


def _opacus_steps(sample_rate: float, steps: int | None, epochs: float | None) -> int:
    """Opacus's step count: `steps`, or int(epochs / sample_rate) (truncated, as Opacus does)."""
    if (steps is None) == (epochs is None):
        raise PrivacyError("get_noise_multiplier takes as input EITHER a number of steps or a "
                           f"number of epochs: pass steps= or epochs= (got steps={steps!r}, "
                           f"epochs={epochs!r}).")
    return check_steps(steps if steps is not None else int(epochs / sample_rate))


def get_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float,
                         epochs: float | None = None, steps: int | None = None,
                         accountant: str = "rdp", epsilon_tolerance: float = 0.01,
                         **kwargs: object) -> float:
    """The sigma whose epsilon after `steps` (or int(epochs / sample_rate) steps) at
    `target_delta` is in [target_epsilon - epsilon_tolerance, target_epsilon]: doubling from
    20 until the target is met, then bisecting [0, sigma_high] (Opacus's search). Raises
    PrivacyError (a ValueError) when even sigma = 1e6 does not reach the target."""
    from dptrain.opacus.accountants import create_accountant

    q, delta = check_sample_rate(sample_rate), check_delta(target_delta)
    n = _opacus_steps(q, steps, epochs)
    acc = create_accountant(accountant)

    def epsilon(sigma: float) -> float:
        acc.history = [(sigma, q, n)]
        return acc.get_epsilon(delta=delta, **kwargs)

    eps_high, sigma_low, sigma_high = float("inf"), 0.0, 10.0
    while eps_high > target_epsilon:
        sigma_high *= 2
        eps_high = epsilon(sigma_high)
        if sigma_high > MAX_SIGMA:
            raise PrivacyError(f"The privacy budget is too low: target_epsilon={target_epsilon} "
                               f"is not reached at target_delta={target_delta} in {n} steps at "
                               f"sample_rate={sample_rate} even with sigma={MAX_SIGMA:g}; raise "
                               "target_epsilon or lower the steps.")
    while target_epsilon - eps_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        eps = epsilon(sigma)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high


__all__ = ["get_noise_multiplier"]
