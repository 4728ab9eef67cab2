"""Banded noise: C lower-triangular Toeplitz with b bands (banded matrix factorization).

C's first column is c = (c_0, ..., c_{b-1}, 0, 0, ...), normalised to ||c||_2 = 1: one
participation moves C x by at most the clipping norm (its column norm), and an example that
participates at most once every b steps (cyclic Poisson sampling with b groups) touches
non-overlapping columns, so the sensitivity stays 1 per participation (Choquette-Choo et al. 2023,
"Amplified banded matrix factorization"). b = 1 is DP-SGD.

Noise: y_t = (Z_t - sum_{k=1}^{b-1} c_k y_{t-k}) / c_0, forward substitution with C, keeping the
b - 1 previous outputs per parameter (b - 1 copies of the trainable parameters).

Coefficients: `Banded.optimised(bands, num_steps)` minimises the mean squared error of the
running sum of the noise, (1/T) ||A C^{-1}||_F^2 ||c||^2 (`toeplitz.loss`, A the all-ones
lower-triangular matrix, or heavy-ball momentum's workload with `momentum`), by L-BFGS with the
exact gradient in O(T b) per evaluation, from the coefficients of the square root of A
(Fichtenberger et al. 2023), which are optimal for the last step's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter
from torch import Tensor

from dptrain.checks import POSITIVE_INT
from dptrain.errors import ConfigError
from dptrain.privacy.noise import toeplitz
from dptrain.privacy.noise.base import NoiseGenerator, check_coefficients

_MAX_ITERATIONS = 500


class BandedGenerator(NoiseGenerator):
    """Forward substitution with C's b coefficients; buffers: the b - 1 last outputs, newest
    first."""

    def __init__(self, coefficients: tuple[float, ...]) -> None:
        super().__init__()
        self.coefficients = coefficients

    def _next(self, buffers: list[Tensor], draw: Tensor, step: int) -> Tensor:
        c = self.coefficients
        for k, previous in enumerate(buffers, start=1):  # y_{t-1}, y_{t-2}, ...
            draw.sub_(previous, alpha=c[k])
        if c[0] != 1.0:
            draw.div_(c[0])
        if len(c) > 1:
            if len(buffers) < len(c) - 1:
                buffers.insert(0, draw.clone())
            else:  # reuse the oldest buffer: no allocation once b - 1 are held
                oldest = buffers.pop()
                buffers.insert(0, oldest.copy_(draw))
        return draw


def sqrt_prefix_coefficients(count: int) -> np.ndarray:
    """The first `count` coefficients of the square root of the prefix-sum matrix A (C with
    C C = A): c_k = binom(2k, k) / 4^k, the column of the series (1 - z)^(-1/2)."""
    k = np.arange(1, count)
    return np.concatenate([[1.0], np.cumprod(1.0 - 0.5 / k)])


def _loss_and_gradient(c: np.ndarray, num_steps: int, momentum: float) -> tuple[float, np.ndarray]:
    """(1/T) ||A C^{-1}||_F^2 ||c||^2 and its gradient in c (shape (b,)), in O(T b).

    With r = C^{-1} e_0, w = M r (M the momentum filter), s = cumsum(w) and
    E = (1/T) sum_k (T - k) s_k^2: dE/ds_k = 2 (T - k) s_k / T, back through the cumsum (a reversed
    cumsum) and M^T (the filter on the reversed sequence) to g = dE/dr; then C r = e_0 gives
    dr/dc_j = -C^{-1} S_j r (S_j the shift by j), so dE/dc_j = -<C^{-T} g, S_j r>.
    """
    b = c.size
    with np.errstate(over="ignore", invalid="ignore"):  # an unstable C^{-1}: inf, refused below
        r = toeplitz.inverse_column(c, num_steps)
        s = toeplitz.workload_column(r, momentum)
        weights = (num_steps - np.arange(num_steps)) / num_steps
        error = float(weights @ (s * s))
    norm2 = float(c @ c)
    if not np.isfinite(error):
        return np.inf, np.zeros(b)
    g = np.cumsum((2.0 * weights * s)[::-1])[::-1]
    if momentum:
        g = lfilter([1.0], [1.0, -momentum], g[::-1])[::-1]
    h = lfilter([1.0], c, g[::-1])[::-1]                     # C^{-T} g
    grad_error = -np.array([h[j:] @ r[:num_steps - j] for j in range(b)])
    return error * norm2, grad_error * norm2 + 2.0 * error * c


def optimise_banded(bands: int, num_steps: int, momentum: float = 0.0) -> np.ndarray:
    """The b coefficients (||c|| = 1, c_0 > 0) minimising `toeplitz.loss` with single
    participation for `num_steps` steps (float64, shape (bands,))."""
    start = sqrt_prefix_coefficients(bands)
    start /= np.linalg.norm(start)
    if bands == 1:
        return start
    scale = _loss_and_gradient(start, num_steps, momentum)[0]

    def objective(c: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = _loss_and_gradient(c, num_steps, momentum)
        if not np.isfinite(value):
            return 1e6, np.zeros_like(c)  # an unstable inverse: the line search backs off
        return value / scale, grad / scale

    result = minimize(objective, start, jac=True, method="L-BFGS-B",
                      options={"maxiter": _MAX_ITERATIONS, "ftol": 1e-13, "gtol": 1e-10})
    best = result.x if result.fun <= 1.0 else start
    best = best / np.linalg.norm(best)
    return best if best[0] > 0 else -best


@dataclass(frozen=True)
class Banded:
    """b-banded Toeplitz noise: `coefficients` = (c_0, ..., c_{b-1}), ||c|| = 1, c_0 > 0.

    Build it with `Banded.optimised(bands, num_steps)`; a given column is normalised here.
    """

    coefficients: tuple[float, ...]

    name = "banded"
    algorithm = "DP-MF (banded matrix factorization)"
    noise_words = "correlated gaussian (banded Toeplitz)"

    @staticmethod
    def preferred_groups(sample_rate: float, bands: int | None = None) -> int:
        """b groups for b bands: each example at most once every b steps (the amplified
        accounting of banded MF); 1 when b is not known yet or 1."""
        return 1 if bands is None else max(1, int(bands))

    def __post_init__(self) -> None:
        c = np.array(check_coefficients(self.coefficients, "privacy.noise banded coefficients",
                                        "the first column of the strategy matrix"))
        norm = float(np.linalg.norm(c))
        if c[0] <= 0:
            raise ConfigError(f"banded noise coefficients {list(c)} must start with a positive "
                              "c_0 (C must be invertible).")
        if abs(norm - 1.0) > 1e-12:  # a normalised column (a recorded one) is kept bit for bit
            c = c / norm
        object.__setattr__(self, "coefficients", tuple(float(v) for v in c))

    @classmethod
    def optimised(cls, bands: int, num_steps: int, momentum: float = 0.0) -> Banded:
        """The b-banded strategy optimised for `num_steps` steps (`optimise_banded`); ConfigError
        naming privacy.noise_bands when b is not an integer in [1, num_steps]."""
        bands = POSITIVE_INT.check(bands, "privacy.noise_bands")
        num_steps = POSITIVE_INT.check(num_steps, "the number of training steps")
        if bands > num_steps:
            raise ConfigError(f"privacy.noise_bands={bands} exceeds the run's {num_steps} steps: "
                              f"use at most {num_steps} bands.")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum={momentum!r} must be in [0, 1) (the optimizer's).")
        return cls(tuple(optimise_banded(bands, num_steps, momentum)))

    @property
    def bands(self) -> int:
        """b, the number of non-zero coefficients allowed (the participation separation the
        accounting needs)."""
        return len(self.coefficients)

    def toeplitz_column(self, num_steps: int) -> np.ndarray:
        """c padded with zeros (or cut) to `num_steps` entries (float64)."""
        return toeplitz.as_column(self.coefficients, num_steps)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "coefficients": list(self.coefficients)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Banded:
        return cls(tuple(data["coefficients"]))

    @property
    def extra_copies(self) -> int:
        return self.bands - 1

    def generator(self) -> BandedGenerator:
        return BandedGenerator(self.coefficients)
