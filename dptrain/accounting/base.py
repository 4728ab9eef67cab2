"""The accountant interface shared by every accounting method.

An accountant records a *history*: runs of identical DP-SGD steps, each a tuple
``(noise_multiplier, sample_rate, steps)``. The noise multiplier sigma is the ratio of the Gaussian
noise standard deviation to the clipping norm (unitless), the sample rate q is the Poisson sampling
probability of each example (unitless, in [0, 1]) and steps is a count. Consecutive identical steps
are merged, so a million steps with a constant sigma and q cost one tuple.

Subclasses implement only the privacy computation on a cleaned history (``_epsilon`` and optionally
``_delta``); validation, merging, the infinite-epsilon rule for sigma == 0 and state handling live
here once.
"""

from __future__ import annotations

import math
import numbers
import warnings
from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dptrain.errors import PrivacyError

Run = tuple[float, float, int]
History = list[Run]

_STATE_VERSION = 1


def check_noise_multiplier(noise_multiplier: float, name: str = "noise_multiplier") -> float:
    """Return sigma as a float; raise PrivacyError unless it is a finite number >= 0."""
    try:
        sigma = float(noise_multiplier)
    except (TypeError, ValueError):
        raise PrivacyError(
            f"{name}={noise_multiplier!r} is not a number: pass the Gaussian noise multiplier "
            "(noise std / clipping norm) as a float >= 0, e.g. 1.0."
        ) from None
    if not math.isfinite(sigma) or sigma < 0:
        raise PrivacyError(
            f"{name}={noise_multiplier!r} is invalid: the noise multiplier must be a finite number "
            ">= 0 (noise std / clipping norm); use e.g. 1.0."
        )
    return sigma


def check_sample_rate(sample_rate: float, name: str = "sample_rate") -> float:
    """Return q as a float; raise PrivacyError unless 0 <= q <= 1."""
    try:
        q = float(sample_rate)
    except (TypeError, ValueError):
        raise PrivacyError(
            f"{name}={sample_rate!r} is not a number: pass the Poisson sampling probability "
            "(expected batch size / dataset size) as a float in (0, 1]."
        ) from None
    if not (0.0 <= q <= 1.0):
        raise PrivacyError(
            f"{name}={sample_rate!r} is outside [0, 1]: the sample rate is the probability that an "
            "example is in a batch, i.e. expected batch size / dataset size; use a value in (0, 1]."
        )
    return q


def check_steps(steps: int, name: str = "steps") -> int:
    """Return steps as an int; raise PrivacyError unless it is an integer >= 0."""
    if (isinstance(steps, bool) or not isinstance(steps, numbers.Real) or not math.isfinite(steps)
            or steps != int(steps)):
        raise PrivacyError(f"{name}={steps!r} is not an integer: pass the number of steps, e.g. 1.")
    if steps < 0:
        raise PrivacyError(f"{name}={steps!r} is negative: the number of steps must be >= 0.")
    return int(steps)


def check_delta(delta: float, name: str = "delta") -> float:
    """Return delta as a float; raise PrivacyError unless 0 < delta < 1."""
    try:
        d = float(delta)
    except (TypeError, ValueError):
        raise PrivacyError(f"{name}={delta!r} is not a number: pass a float in (0, 1), e.g. 1e-5.") from None
    if not (0.0 < d < 1.0):
        raise PrivacyError(
            f"{name}={delta!r} is outside (0, 1): delta is a probability of failure; use a value "
            "well below 1/dataset_size, e.g. 1e-5."
        )
    return d


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """Return epsilon as a float; raise PrivacyError unless it is a number >= 0."""
    try:
        e = float(epsilon)
    except (TypeError, ValueError):
        raise PrivacyError(f"{name}={epsilon!r} is not a number: pass a float >= 0, e.g. 3.0.") from None
    if math.isnan(e) or e < 0:
        raise PrivacyError(f"{name}={epsilon!r} is invalid: epsilon must be a number >= 0, e.g. 3.0.")
    return e


def merge_runs(runs: Iterable[Run]) -> History:
    """Merge consecutive runs with identical (sigma, q); drop runs of 0 steps."""
    merged: History = []
    for sigma, q, steps in runs:
        if steps == 0:
            continue
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1] = (sigma, q, merged[-1][2] + steps)
        else:
            merged.append((sigma, q, steps))
    return merged


def normalize_history(history: Iterable[Sequence[Any] | Mapping[str, Any]]) -> History:
    """Validate a history given as tuples or {noise_multiplier, sample_rate, steps} mappings."""
    runs: History = []
    for i, run in enumerate(history):
        if isinstance(run, Mapping):
            try:
                run = (run["noise_multiplier"], run["sample_rate"], run["steps"])
            except KeyError as e:
                raise PrivacyError(
                    f"history[{i}] lacks key {e}: each run needs noise_multiplier, sample_rate, steps."
                ) from None
        if len(run) != 3:
            raise PrivacyError(
                f"history[{i}]={run!r} is not a (noise_multiplier, sample_rate, steps) triple."
            )
        runs.append((
            check_noise_multiplier(run[0], f"history[{i}].noise_multiplier"),
            check_sample_rate(run[1], f"history[{i}].sample_rate"),
            check_steps(run[2], f"history[{i}].steps"),
        ))
    return merge_runs(runs)


def _log_with_zero_apart(values: np.ndarray) -> np.ndarray:
    """log(values) [R], with log(0) replaced by a value 50 below every other one, so that zeros
    (sigma == 0 or q == 0 runs) never share a grid cell with non-zero values."""
    positive = values > 0
    logs = np.log(np.where(positive, values, 1.0))
    floor = (logs[positive].min() if positive.any() else 0.0) - 50.0
    return np.where(positive, logs, floor)


def _grid_cells(log_sigma: np.ndarray, log_q: np.ndarray, ratio: float) -> tuple[int, np.ndarray]:
    """Number of occupied cells and the cell index [R] of each run on a geometric grid of
    `ratio` (cells [r^k, r^(k+1)) in both sigma and q)."""
    width = math.log1p(ratio)
    sigma_cell = np.floor(log_sigma / width).astype(np.int64)
    q_cell = np.floor(log_q / width).astype(np.int64)
    q_span = int(q_cell.max() - q_cell.min()) + 1
    key = (sigma_cell - sigma_cell.min()) * q_span + (q_cell - q_cell.min())
    cells, index = np.unique(key, return_inverse=True)
    return cells.size, index.ravel()


def coarsen_history(runs: History, max_pairs: int) -> History:
    """At most `max_pairs` runs that dominate `runs`, with the same total number of steps.

    Runs are first aggregated by (sigma, q) (composition commutes). If more than `max_pairs`
    distinct pairs remain (a noise or sample-rate schedule), they are grouped into the cells of a
    geometric grid in (sigma, q) (the finest ratio, to about 5%, for which at most `max_pairs`
    cells are occupied) and each group becomes one run with the group's SMALLEST sigma and LARGEST
    q. Less noise and more sampling only lose privacy, so the result dominates the input: any
    upper bound computed for it holds for the input; a value that is constant over the history
    (e.g. q under a noise schedule) is kept exactly.
    """
    agg: dict[tuple[float, float], int] = {}
    for sigma, q, steps in runs:
        agg[(sigma, q)] = agg.get((sigma, q), 0) + steps
    if len(agg) <= max_pairs:
        return [(s, q, n) for (s, q), n in agg.items()]
    pairs = np.array(list(agg), dtype=np.float64)                     # [R, 2]: (sigma, q)
    counts = np.array(list(agg.values()), dtype=np.int64)             # [R]
    log_sigma, log_q = _log_with_zero_apart(pairs[:, 0]), _log_with_zero_apart(pairs[:, 1])
    fine, coarse = 0.0, 1e-3
    while _grid_cells(log_sigma, log_q, coarse)[0] > max_pairs:
        fine, coarse = coarse, 2 * coarse
    while fine > 0 and coarse > 1.05 * fine:                           # bisect the ratio
        mid = math.sqrt(fine * coarse)
        if _grid_cells(log_sigma, log_q, mid)[0] <= max_pairs:
            coarse = mid
        else:
            fine = mid
    size, cell = _grid_cells(log_sigma, log_q, coarse)
    sigma_min = np.full(size, np.inf)
    np.minimum.at(sigma_min, cell, pairs[:, 0])
    q_max = np.zeros(size)
    np.maximum.at(q_max, cell, pairs[:, 1])
    steps = np.zeros(size, dtype=np.int64)
    np.add.at(steps, cell, counts)
    return [(float(s), float(q), int(n)) for s, q, n in zip(sigma_min, q_max, steps)]


def spending_runs(history: History) -> History:
    """The runs that spend privacy: q > 0 (a q == 0 step never touches the data)."""
    return [run for run in history if run[1] > 0.0]


def has_infinite_loss(history: History) -> bool:
    """True when some step with q > 0 used sigma == 0 (no noise: epsilon is infinite)."""
    return any(sigma == 0.0 for sigma, _, _ in spending_runs(history))


def warn_infinite(name: str) -> None:
    """Warn that a history with sigma == 0 has an infinite epsilon."""
    warnings.warn(
        f"{name} accountant: a step with noise_multiplier=0 and sample_rate>0 was taken, so no "
        "finite (epsilon, delta) guarantee holds: epsilon is infinite.",
        UserWarning,
        stacklevel=3,
    )


class Accountant(ABC):
    """Base class: a history of DP-SGD steps and its privacy cost.

    Subclasses set ``name``, ``approximate`` (True when the result is not a guaranteed upper
    bound) and implement ``_epsilon(history, delta)`` for a non-empty history of runs with
    sigma > 0 and q > 0.
    """

    name: str = ""
    approximate: bool = False

    def __init__(self) -> None:
        self._history: History = []

    # ---- history ---------------------------------------------------------------------------
    @property
    def history(self) -> History:
        """Runs of identical steps: list of (noise_multiplier, sample_rate, steps)."""
        return list(self._history)

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record `steps` DP-SGD steps with noise multiplier sigma and sample rate q.

        sigma == 0 (with q > 0) is recorded and makes epsilon infinite (with a warning); q == 0
        steps are recorded but spend nothing; steps == 0 records nothing.
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = check_steps(steps)
        if sigma == 0.0 and q > 0.0 and n > 0:
            warn_infinite(self.name)
        if n == 0:
            return
        last = self._history[-1] if self._history else None
        if last is not None and last[0] == sigma and last[1] == q:
            self._history[-1] = (sigma, q, last[2] + n)   # O(1): merge with the last run
        else:
            self._history.append((sigma, q, n))

    @classmethod
    def from_history(cls, history: Iterable[Sequence[Any] | Mapping[str, Any]]) -> "Accountant":
        """A new accountant holding a (validated) copy of `history`."""
        acc = cls()
        acc._history = normalize_history(history)
        return acc

    # ---- privacy ---------------------------------------------------------------------------
    def get_epsilon(self, delta: float) -> float:
        """Epsilon (natural-log units) of the whole history at `delta`; math.inf if sigma == 0."""
        d = check_delta(delta)
        runs = spending_runs(self._history)
        if not runs:
            return 0.0
        if has_infinite_loss(runs):
            warn_infinite(self.name)
            return math.inf
        return float(self._epsilon(runs, d))

    def get_delta(self, epsilon: float) -> float:
        """Smallest delta this method certifies at `epsilon`; 1.0 if sigma == 0 was stepped."""
        e = check_epsilon(epsilon)
        runs = spending_runs(self._history)
        if not runs:
            return 0.0
        if has_infinite_loss(runs):
            warn_infinite(self.name)
            return 1.0
        return float(min(1.0, max(0.0, self._delta(runs, e))))

    @abstractmethod
    def _epsilon(self, runs: History, delta: float) -> float:
        """Epsilon of a non-empty history of runs with sigma > 0, q > 0, steps > 0."""

    @abstractmethod
    def _delta(self, runs: History, epsilon: float) -> float:
        """Delta of a non-empty history of runs with sigma > 0, q > 0, steps > 0."""

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON/torch-serialisable snapshot: {"name", "version", "history"}."""
        return {
            "name": self.name,
            "version": _STATE_VERSION,
            "history": [[s, q, n] for s, q, n in self._history],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the history saved by `state_dict` (the accountant name must match)."""
        name = state_dict.get("name", self.name)
        if name != self.name:
            raise PrivacyError(
                f"state_dict of a {name!r} accountant cannot be loaded into a {self.name!r} "
                "accountant: build the accountant with get_accountant(state_dict['name'])."
            )
        if "history" not in state_dict:
            raise PrivacyError("state_dict lacks 'history': pass the output of Accountant.state_dict().")
        self._history = normalize_history(state_dict["history"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={len(self)}, runs={len(self._history)})"
