"""Lower-triangular Toeplitz matrices by their first column, and the error of a factorization.

A noise strategy is a T x T lower-triangular Toeplitz matrix C, held as its first column
c = (c_0, ..., c_{T-1}) (float64; entries past a short column are 0). The model receives, at step
t, the noise (C^{-1} Z)_t with Z of i.i.d. Gaussian rows. Every quantity here is computed from
columns in O(T * len(c)) time and O(T) memory, never from a T x T matrix:

* `inverse_column(c, T)`: the first column r of C^{-1} (C^{-1} is again lower-triangular
  Toeplitz), by the recursion r = lfilter(1, c, e_0).
* `mean_error(r)`: the training workload's error, (1/T) ||A C^{-1}||_F^2 for unit-variance Z, with
  A the all-ones lower-triangular matrix (the running sum of the updates: plain SGD) or, with
  `momentum` beta, A[t, s] = (1 - beta^(t-s+1)) / (1 - beta) (heavy-ball momentum). A C^{-1} is
  Toeplitz with first column a * r, so the error of query t is sum_{k<=t} (a * r)_k^2.
* `min_separation_sensitivity_squared(c, ...)`: sensitivity^2 of C when an example participates at
  most k times, at least `min_sep` steps apart, for a non-negative non-increasing column (the
  worst case then participates at steps 0, min_sep, 2 min_sep, ...).
* `loss(c, ...)`: mean error times sensitivity^2, the objective the strategies are optimised for.
  It measures utility only: the privacy of a run is accounted from its column by
  dptrain.accounting, whatever the column was optimised for.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.signal import lfilter


def as_column(c: np.ndarray | list[float], num_steps: int) -> np.ndarray:
    """`c` as a float64 column of length `num_steps` (cut, or padded with zeros)."""
    c = np.asarray(c, dtype=np.float64).ravel()[:num_steps]
    return np.pad(c, (0, num_steps - c.size))


def unit_impulse(num_steps: int) -> np.ndarray:
    """e_0 of length `num_steps` (float64)."""
    e = np.zeros(num_steps)
    e[0] = 1.0
    return e


def inverse_column(c: np.ndarray, num_steps: int) -> np.ndarray:
    """The first column r of C^{-1} (float64, shape (num_steps,)) for C of first column `c`
    (any length; c_0 != 0): forward substitution r_t = (e_0 - sum_{k>=1} c_k r_{t-k})_t / c_0."""
    c = np.asarray(c, dtype=np.float64)[:num_steps]
    return lfilter([1.0], c, unit_impulse(num_steps))


def workload_column(r: np.ndarray, momentum: float = 0.0) -> np.ndarray:
    """The first column of A C^{-1} for C^{-1}'s column `r`: cumsum(r), through the momentum
    filter 1 / (1 - beta z) first when `momentum` beta > 0."""
    if momentum:
        r = lfilter([1.0], [1.0, -momentum], r)
    return np.cumsum(r)


def per_query_error(r: np.ndarray, momentum: float = 0.0) -> np.ndarray:
    """Expected squared error of each query t of the workload (shape (T,)), for unit-variance
    noise: sum_{k<=t} (A C^{-1})_{k,0}^2, the squared norm of row t of A C^{-1}."""
    return np.cumsum(workload_column(r, momentum) ** 2)


def mean_error(r: np.ndarray, momentum: float = 0.0) -> float:
    """(1/T) ||A C^{-1}||_F^2: the mean over the T steps of the expected squared error of the
    workload's running sum, per unit noise variance (independent noise: (T + 1) / 2)."""
    return float(np.mean(per_query_error(r, momentum)))


def participations(num_steps: int, min_sep: int, max_participations: int | None) -> int:
    """How many times an example can participate in `num_steps` steps at least `min_sep` apart,
    capped by `max_participations` (None: no cap)."""
    most = math.ceil(num_steps / min_sep)
    return most if max_participations is None else min(most, int(max_participations))


def min_separation_sensitivity_squared(c: np.ndarray, num_steps: int, min_sep: int = 1,
                                       max_participations: int | None = 1) -> float:
    """Sensitivity^2 of C (column `c`, non-negative and non-increasing) for an example that
    participates at most `max_participations` times, `min_sep` or more steps apart: the squared
    norm of the sum of the columns 0, min_sep, 2 min_sep, ... (k of them, `participations`)."""
    c = as_column(c, num_steps)
    k = participations(num_steps, min_sep, max_participations)
    padded = np.pad(c, (0, (-num_steps) % min_sep))
    every = padded.reshape(-1, min_sep).cumsum(axis=0).ravel()  # all earlier participations
    summed = every.copy()
    summed[k * min_sep:] -= every[:every.size - k * min_sep]      # keep the last k of them
    summed = summed[:num_steps]
    return float(summed @ summed)


def loss(c: np.ndarray, num_steps: int, *, momentum: float = 0.0, min_sep: int = 1,
         max_participations: int | None = 1, r: np.ndarray | None = None) -> float:
    """Mean squared error of the workload times sensitivity^2 (the strategy's figure of merit,
    lower is better; `r` = C^{-1}'s column when already known). For c = (1,) (independent
    noise), single participation and no momentum: (T + 1) / 2."""
    if r is None:
        r = inverse_column(c, num_steps)
    return mean_error(r, momentum) * min_separation_sensitivity_squared(
        c, num_steps, min_sep, max_participations)


def dense_matrix(c: np.ndarray, num_steps: int) -> np.ndarray:
    """The T x T lower-triangular Toeplitz matrix of column `c` (tests and small T only)."""
    c = as_column(c, num_steps)
    index = np.subtract.outer(np.arange(num_steps), np.arange(num_steps))
    return np.where(index >= 0, c[np.clip(index, 0, None)], 0.0)
