"""Sensitivity and epsilon of correlated-noise (matrix-factorization) mechanisms.

A correlated-noise mechanism releases, at step t, the clipped sum x_t plus the noise
(C^{-1} Z)_t, where C is a T x T lower-triangular Toeplitz *strategy matrix* given by its first
column c = (c_0, ..., c_{T-1}) and Z has i.i.d. rows N(0, (sigma clip)^2 I). What it releases is a
post-processing of C x + Z, so its privacy is that of a Gaussian mechanism on C x: one example
taking part at the steps of a *participation pattern* pi moves C x by C u, u the contributions
(rows of norm <= clip) at the steps of pi. Everything below is in units of clip.

Sensitivity (Choquette-Choo et al. 2023, "Multi-epoch matrix factorization mechanisms"; Kalinin
and Lampert 2024): sens(C) = sup over patterns pi of the schema and contributions u of ||C u||.
With G = C^T C, ||C u||^2 <= sum_{i, j in pi} |G_ij|, with equality when G >= 0 on pi (all
contributions equal) and when the columns of pi are orthogonal. Two schemas (`Participation`):

* ``min_separation``: at most m participations, any two at least k steps apart (cyclic Poisson
  sampling in k groups: an example only ever takes part at the steps of its group).
* ``one_per_block``: at most one participation in each block [e k, (e + 1) k) of k steps
  (shuffled batches: one batch per epoch, at an unknown position; two participations can then be
  adjacent, at the end of one epoch and the start of the next).

`sensitivity` computes it exactly where a closed form holds and refuses other columns:
  - columns that are b-banded (c_k = 0 for k >= b) with b <= k under ``min_separation``: the
    columns of a pattern are orthogonal, sens^2 = sum of their squared norms (exact);
  - nonnegative, non-increasing columns (BLT, banded square roots) under ``min_separation``: the
    earliest, tightest pattern 0, k, 2k, ... is the worst (Kalinin and Lampert 2024, Thm. 2;
    Dvijotham et al. 2024 use it for BLT): sens = ||C (e_0 + e_k + ... + e_{(m-1)k})|| (exact);
  - under ``one_per_block``: an upper bound, the sum over pairs of blocks of the largest |G_ij|
    between them (for nonnegative non-increasing columns G is largest at the closest, earliest
    pair; for b-banded columns with b <= k only neighbouring blocks interact).

Epsilon (three events; `dptrain.accounting.events.CorrelatedNoiseAccountant` picks one):

* **Amplified (Choquette-Choo et al. 2023, "Amplified banded matrix factorization").** Cyclic
  Poisson sampling with b groups (each example's group drawn independently, whatever the sizes
  that gives; group t mod b Poisson-sampled at step t with rate q_group) and
  a column with at most b bands: each example's participations are b steps apart and its columns
  orthogonal, and the mechanism is dominated by DP-SGD with sample rate q_group and noise
  multiplier sigma / ||c|| over ceil(T / b) rounds, under the add/remove relation as Poisson
  DP-SGD. The rounds are then charged by OUR accountants (prv, rdp, gdp) as DP-SGD steps
  (`amplified_history`). b = 1 and c = (1,) is DP-SGD itself, the same history exactly.
* **Unamplified, add/remove** (Poisson or cyclic Poisson with a column of more bands than
  groups): conditioned on the sampling, one Gaussian mechanism of sensitivity clip sens(C) under
  ``min_separation`` with k = groups: mu = sens / sigma (mu-GDP, Dong, Roth, Su 2019).
* **Unamplified, substitution** (shuffled batches): the relation of dptrain.accounting.shuffle,
  replacing one example moves each of its batches' sums by at most 2 clip, under
  ``one_per_block`` with k = steps per epoch: mu = 2 sens / sigma. c = (1, 0, ...) gives
  sens = sqrt(epochs), the shuffle accounting's mu exactly.

A noise schedule (sigma_t varying) is charged conservatively: the whitened column diag(1/sigma) C
e_t has norm <= ||c|| / min sigma over the rows it touches, so each amplified round takes the
smallest sigma of the rows its participations touch, and an unamplified run its smallest sigma.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dptrain.accounting.history import History, merge_history, steps_per_epoch
from dptrain.errors import PrivacyError

PARTICIPATIONS = ("min_separation", "one_per_block")


class ToeplitzStrategy(Protocol):
    """What the accounting needs of a noise strategy: its first column for a run of T steps."""

    def toeplitz_column(self, num_steps: int) -> np.ndarray:  # float64 [num_steps]
        ...


@dataclass(frozen=True)
class Participation:
    """How one example may take part in a run: at most `max_participations` (m) times, either
    at least `separation` (k) steps apart (`min_separation`) or at most once in each block of k
    consecutive steps (`one_per_block`)."""

    kind: str
    separation: int
    max_participations: int

    def __post_init__(self) -> None:
        if self.kind not in PARTICIPATIONS:
            raise PrivacyError(f"participation kind {self.kind!r} is unknown: use one of "
                               f"{list(PARTICIPATIONS)}.")
        if int(self.separation) < 1 or int(self.max_participations) < 1:
            raise PrivacyError(f"participation separation={self.separation!r} and "
                               f"max_participations={self.max_participations!r} must be >= 1.")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "separation": int(self.separation),
                "max_participations": int(self.max_participations)}


# ---------------------------------------------------------------------------------------------
# The column
# ---------------------------------------------------------------------------------------------
def check_column(column: Any, num_steps: int | None = None) -> np.ndarray:
    """The column as float64 [T] (T = `num_steps` when given: cut or zero-padded); PrivacyError
    unless it is finite with c_0 > 0 (C invertible)."""
    c = np.asarray(column, dtype=np.float64).ravel()
    if num_steps is not None:
        c = np.concatenate([c[:num_steps], np.zeros(max(0, num_steps - c.size))])
    if c.size == 0 or not np.all(np.isfinite(c)) or not c[0] > 0:
        raise PrivacyError(f"the noise strategy's column {c[:8].tolist()}... must be finite with "
                           "c_0 > 0 (an invertible lower-triangular strategy matrix).")
    return c


def bands(column: np.ndarray) -> int:
    """Number of bands b of a column: 1 + the index of its last non-zero entry."""
    nonzero = np.flatnonzero(column)
    return int(nonzero[-1]) + 1 if nonzero.size else 0


def is_nonnegative_nonincreasing(column: np.ndarray) -> bool:
    """c_k >= 0 and c_{k+1} <= c_k for every k (exactly)."""
    return bool(np.all(column >= 0) and np.all(np.diff(column) <= 0))


def _gram(column: np.ndarray, i: int, j: int) -> float:
    """G_ij = (C^T C)_ij = sum_{s < T - max(i, j)} c_s c_{s + |i - j|} of the Toeplitz C."""
    t, d = column.size, abs(i - j)
    length = t - max(i, j)
    return float(np.dot(column[:length], column[d:d + length])) if length > 0 else 0.0


def _max_abs_lag_sum(column: np.ndarray, lag: int) -> float:
    """max over L of |sum_{s < L} c_s c_{s + lag}| (a truncated column of C has any L)."""
    products = column[:column.size - lag] * column[lag:]
    return float(np.max(np.abs(np.cumsum(products)), initial=0.0))


# ---------------------------------------------------------------------------------------------
# Sensitivity
# ---------------------------------------------------------------------------------------------
def _orthogonal_sensitivity(c: np.ndarray, starts: range) -> float:
    """sqrt(sum_j ||C e_j||^2) over the columns j in `starts` (orthogonal ones): column j of the
    Toeplitz C is c cut to its first T - j entries."""
    prefix = np.concatenate([[0.0], np.cumsum(c * c)])   # prefix[L] = ||c[:L]||^2
    return math.sqrt(float(sum(prefix[c.size - j] for j in starts)))


def _min_separation_sensitivity(c: np.ndarray, k: int, m: int) -> float:
    t = c.size
    starts = range(0, min(m * k, t), k)
    if bands(c) <= k:
        return _orthogonal_sensitivity(c, starts)
    if is_nonnegative_nonincreasing(c):
        v = np.zeros(t)
        for j in starts:
            v[j:] += c[:t - j]
        return float(np.linalg.norm(v))
    raise PrivacyError(
        f"no sensitivity bound is known for this noise strategy under participations {k} steps "
        f"apart: its column has {bands(c)} bands (more than {k}) and is not nonnegative and "
        "non-increasing. Use privacy.noise=banded with at most as many bands as sampling groups, "
        "or a BLT strategy with a decreasing column.")


def _one_per_block_sensitivity(c: np.ndarray, k: int, m: int) -> float:
    t = c.size
    blocks = min(m, math.ceil(t / k))
    starts = range(0, blocks * k, k)
    bounds: list[float] = []
    b = bands(c)
    if b <= k:
        # same-block: one column each; neighbouring blocks: columns less than b apart overlap
        cross = max((_max_abs_lag_sum(c, d) for d in range(1, b)), default=0.0)
        diagonal = _orthogonal_sensitivity(c, starts) ** 2
        bounds.append(math.sqrt(diagonal + 2.0 * max(blocks - 1, 0) * cross))
    if is_nonnegative_nonincreasing(c):
        bounds.append(math.sqrt(_decreasing_block_pairs(c, k, blocks)))
    if not bounds:
        raise PrivacyError(
            f"no sensitivity bound is known for this noise strategy under one participation per "
            f"epoch of {k} steps: its column has {bands(c)} bands (more than {k}) and is not "
            "nonnegative and non-increasing. Use a banded strategy with fewer bands than steps "
            "per epoch, or a BLT strategy with a decreasing column.")
    return min(bounds)


def _decreasing_block_pairs(c: np.ndarray, k: int, blocks: int) -> float:
    """sum over pairs of blocks (e <= f) of the largest G_ij between them, for a nonnegative
    non-increasing column: G(ek, ek) on the diagonal, 2 G((e+1)k - 1, fk) off it (the closest,
    earliest pair; G falls with the lag and with the later index). One cumulative sum per lag
    (f - e - 1) k + 1: O(blocks T)."""
    t = c.size
    squares = np.concatenate([[0.0], np.cumsum(c * c)])          # squares[L] = ||c[:L]||^2
    total = float(sum(squares[t - e * k] for e in range(blocks)))
    for gap in range(blocks - 1):                                  # f - e - 1
        lag = gap * k + 1
        sums = np.concatenate([[0.0], np.cumsum(c[:t - lag] * c[lag:])])
        later = np.arange(gap + 1, blocks) * k                     # f k for f = gap+1 ...
        total += 2.0 * float(np.sum(sums[np.maximum(t - later, 0)]))
    return total


def sensitivity(column: Any, participation: Participation) -> float:
    """sens(C) in units of clip: sup ||C u|| over the participation patterns (see the module
    docstring for the exact cases and the bound); `column` [T] is C's first column."""
    c = check_column(column)
    k, m = int(participation.separation), int(participation.max_participations)
    if participation.kind == "min_separation":
        return _min_separation_sensitivity(c, k, m)
    return _one_per_block_sensitivity(c, k, m)


def column_norm(column: Any) -> float:
    """||c||_2: the largest column norm of C, the sensitivity of one participation."""
    return float(np.linalg.norm(check_column(column)))


# ---------------------------------------------------------------------------------------------
# Events
# ---------------------------------------------------------------------------------------------
def _steps(history: History) -> tuple[np.ndarray, np.ndarray]:
    """(sigma_t, q_t) of every step of a history, float64 [T] each."""
    sigmas = np.repeat([s for s, _, _ in history], [n for _, _, n in history]).astype(np.float64)
    rates = np.repeat([q for _, q, _ in history], [n for _, _, n in history]).astype(np.float64)
    return sigmas, rates


def _per_round(values: np.ndarray, groups: int, fill: float, reduce: Any) -> np.ndarray:
    """`reduce` over each round of `groups` consecutive steps (the last one padded by `fill`)."""
    rounds = math.ceil(values.size / groups)
    padded = np.full(rounds * groups, fill)
    padded[:values.size] = values
    return reduce(padded.reshape(rounds, groups), axis=1)


def amplified_history(history: History, groups: int, column: Any) -> History:
    """The DP-SGD history that dominates a banded mechanism under cyclic Poisson sampling.

    `history` holds every step (q = 0 ones too: they keep the steps' positions) as runs of
    (sigma, q, steps), q being each example's overall share of a batch (the group's sample rate
    is q_group = groups * q); `column` [>= 1] has at most `groups` bands. Round r (steps
    [r b, (r + 1) b)) becomes one DP-SGD step with sample rate min(1, b max q) and noise
    multiplier (the smallest sigma of the rows its participations touch) / ||c||: rounds r and
    r + 1 for a column of several bands, round r for one band. A constant history of T steps
    gives ceil(T / b) identical rounds; b = 1 with c = (1,) gives the history itself.
    """
    b = int(groups)
    c = check_column(column)
    if bands(c) > b:
        raise PrivacyError(f"a strategy of {bands(c)} bands is amplified only with at least as "
                           f"many sampling groups, got {b}: set privacy.sampling_groups={bands(c)}.")
    norm = float(np.linalg.norm(c))
    if len(history) == 1:
        sigma, q, steps = history[0]
        return merge_history([(sigma / norm, min(1.0, b * q), math.ceil(steps / b))])
    sigmas, rates = _steps(history)
    sigma_round = _per_round(sigmas, b, math.inf, np.min)
    if bands(c) > 1:  # a participation at the end of round r touches rows of round r + 1
        sigma_round = np.minimum(sigma_round, np.append(sigma_round[1:], math.inf))
    q_round = np.minimum(1.0, b * _per_round(rates, b, 0.0, np.max))
    return merge_history([(float(s) / norm, float(q), 1) for s, q in zip(sigma_round, q_round)])


def unamplified_mu(history: History, column: Any, participation: Participation,
                   relation_factor: float) -> float:
    """mu (GDP) of a correlated-noise run conditioned on its sampling: relation_factor *
    sens(C) / min sigma (relation_factor 1 for add/remove, 2 for substitution); 0 for an empty
    history, inf when a step used sigma = 0."""
    if not history:
        return 0.0
    sigma = min(s for s, _, _ in history)
    if sigma == 0.0:
        return math.inf
    steps = sum(n for _, _, n in history)
    return relation_factor * sensitivity(check_column(column, steps), participation) / sigma


def shuffle_participation(history: History) -> Participation:
    """One participation per epoch of ceil(1 / q) steps, as many epochs as the history starts."""
    rates = {q for _, q, _ in history}
    if len(rates) != 1:
        raise PrivacyError(f"a shuffled history has one sample rate, got {sorted(rates)}.")
    k = steps_per_epoch(next(iter(rates)))
    return Participation("one_per_block", k, math.ceil(sum(n for _, _, n in history) / k))


def cyclic_participation(history: History, groups: int) -> Participation:
    """Participations at least `groups` steps apart, at most ceil(T / groups) of them."""
    steps = sum(n for _, _, n in history)
    return Participation("min_separation", int(groups), max(1, math.ceil(steps / groups)))


__all__ = ["PARTICIPATIONS", "Participation", "ToeplitzStrategy", "amplified_history", "bands",
           "check_column", "column_norm", "cyclic_participation", "is_nonnegative_nonincreasing",
           "sensitivity", "shuffle_participation", "unamplified_mu"]
