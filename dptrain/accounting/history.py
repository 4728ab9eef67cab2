"""The privacy history: runs of identical DP-SGD steps, `(noise_multiplier, sample_rate, steps)`.

The noise multiplier sigma is the ratio of the Gaussian noise standard deviation to the clipping
norm (unitless), the sample rate q the Poisson sampling probability of each example (unitless, in
[0, 1]) and steps a count. Consecutive identical steps are one run, so a million steps with a
constant sigma and q cost one tuple. Every operation on a history lives here: merging, counting,
cutting (truncate / steps_after), its JSON form (the ledger's), validation and the dominating
coarsening the accountants use for long schedules. The accountants (dptrain.accounting) record
one; the run's ledger (dptrain.train.ledger) writes it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dptrain.checks import check_noise_multiplier, check_sample_rate, check_steps
from dptrain.errors import PrivacyError

Run = tuple[float, float, int]
History = list[Run]


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps in one epoch at Poisson sample rate q: ceil(1 / q).

    The one rule for the length of an epoch, used by the private loaders (steps per epoch), the
    trainer (`train.epochs`), calibration to a target epsilon and `dptrain-privacy --epochs`. For
    q = B / N it is ceil(N / B), the length of a DataLoader of batch size B over N examples
    (the last, partial batch kept), so one epoch samples at least N examples in expectation.
    """
    inverse = 1.0 / check_sample_rate(sample_rate)  # q in (0, 1]: q = 0 has no epoch length
    # 1/(B/N) may round just above an integer N/B; no true ceil(N/B) is that close to it
    return max(1, math.ceil(inverse * (1.0 - 1e-12)))


def merge_history(runs: Iterable[Sequence[float]]) -> History:
    """Normalize runs of (sigma, q, steps): drop empty runs, merge adjacent identical ones."""
    merged: History = []
    for sigma, q, steps in runs:
        if int(steps) <= 0:
            continue
        if merged and merged[-1][0] == float(sigma) and merged[-1][1] == float(q):
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + int(steps))
        else:
            merged.append((float(sigma), float(q), int(steps)))
    return merged


def history_steps(history: Sequence[Sequence[float]]) -> int:
    """Total number of steps in a history of runs."""
    return int(sum(int(run[2]) for run in history))


def history_to_json(history: History) -> list[dict[str, Any]]:
    """Runs as JSON objects {"noise_multiplier", "sample_rate", "steps"}."""
    return [{"noise_multiplier": s, "sample_rate": q, "steps": n} for s, q, n in history]


def history_from_json(runs: list[dict[str, Any]]) -> History:
    """Inverse of `history_to_json`."""
    return [(float(r["noise_multiplier"]), float(r["sample_rate"]), int(r["steps"])) for r in runs]


def truncate_history(history: History, steps: int) -> History:
    """The first `steps` steps of a history."""
    out: History = []
    left = int(steps)
    for sigma, q, n in history:
        if left <= 0:
            break
        out.append((sigma, q, min(n, left)))
        left -= n
    return out


def steps_after(history: History, steps: int) -> History:
    """The steps of `history` after its first `steps` (the complement of truncate_history)."""
    out: History = []
    skip = int(steps)
    for sigma, q, n in history:
        kept = n - min(n, skip)
        skip -= n - kept
        if kept:
            out.append((sigma, q, kept))
    return merge_history(out)


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
            check_sample_rate(run[1], f"history[{i}].sample_rate", allow_zero=True),
            check_steps(run[2], f"history[{i}].steps"),
        ))
    return merge_history(runs)


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
