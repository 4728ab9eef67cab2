"""What a run has spent and may still spend: the budget guard and the ledger's commits ahead.

`PrivacySpend` keeps the run's side of the ledger: the steps of this process's accountant, the
steps of earlier processes a resume kept (charged in addition, or replayed and retaken one for
one; dptrain.train.replay), and the steps committed ahead of the data. Before the data of a step
is read, `ensure_committed` commits the next block: up to `COMMIT_BLOCK_STEPS` steps, never past
the end of the epoch, `max_steps` or the budget, so a killed run over-reports by at most one block
(50 steps, or one epoch when shorter) and pays one ledger write (two fsyncs and one epsilon) per
block rather than per step. Each committed step carries the exact (sigma, q) the optimizer will
use: schedules are pure functions of the step index, so the upcoming values are known before the
step runs. `BudgetGuard` admits only the steps that keep epsilon within the target.
"""

from __future__ import annotations

import math
from typing import Any

from dptrain.accounting.history import History, history_steps, merge_history, steps_after
from dptrain.train.job import Position, TrainingJob
from dptrain.train.ledger import PrivacyLedger, epsilon_of, ledger_sampling
from dptrain.train.replay import with_replayed

COMMIT_BLOCK_STEPS = 50   # at most this many steps committed ahead (bounded over-report on crash)


class BudgetGuard:
    """Admits only the steps that keep epsilon <= `target_epsilon` under the run's accountant.

    `admissible(done, upcoming)` is the largest m such that epsilon(done + upcoming[:m]) <=
    target at `delta`. When every step has the same (sigma, q), the largest admissible number of
    steps is found once by bisection and cached, so each check is an integer comparison; otherwise
    m is found by bisection over the upcoming block (epsilon grows with every step).
    """

    def __init__(self, target_epsilon: float | None, delta: float | None,
                 accountant: str | None, sampling: str = "poisson") -> None:
        self.target = target_epsilon
        self.delta = delta
        self.accountant = accountant
        self.sampling = sampling   # poisson | shuffle: how the history is accounted
        self._max_steps: dict[tuple[float, float], int] = {}

    def admissible(self, done: History, upcoming: History) -> int:
        """How many steps of `upcoming` (in order) can follow `done` within the target."""
        count = history_steps(upcoming)
        if self.target is None or count == 0:
            return count
        kinds = {(run[0], run[1]) for run in list(done) + list(upcoming)}
        if len(kinds) == 1:
            sigma, q = kinds.pop()
            return max(0, min(count, self.max_steps(sigma, q) - history_steps(done)))
        runs = [(s, q, 1) for s, q, n in upcoming for _ in range(int(n))]
        return _largest_fitting(count, lambda m: self._fits(list(done) + runs[:m]))

    def max_steps(self, sigma: float, q: float) -> int:
        """Largest k with epsilon(k steps of (sigma, q)) <= target (0 if even one step exceeds)."""
        key = (float(sigma), float(q))
        if key not in self._max_steps:
            self._max_steps[key] = _largest_fitting(
                None, lambda k: self._fits([(key[0], key[1], k)]))
        return self._max_steps[key]

    def _fits(self, history: History) -> bool:
        history = merge_history(history)
        return epsilon_of(history, self.delta, self.accountant, self.sampling) <= self.target


def _largest_fitting(limit: int | None, fits: Any) -> int:
    """Largest m in [0, limit] (limit None: unbounded, capped at 2**40) with fits(m) True,
    for a monotone predicate (True up to some m, False after); fits(0) is assumed True."""
    cap = 2**40 if limit is None else limit
    if cap == 0 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):        # invariant: fits(lo)
        lo, hi = hi, hi * 2
    if hi > cap:
        if fits(cap):
            return cap
        hi = cap
    while hi - lo > 1:                   # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class PrivacySpend:
    """The privacy the run has spent and commits, in the ledger and against the guard.

    `position` is the run's (shared, updated in place by the loop); `ledger` the run's ledger.
    """

    def __init__(self, job: TrainingJob, ledger: PrivacyLedger, guard: BudgetGuard,
                 position: Position) -> None:
        self.job, self.ledger, self.guard, self.pos = job, ledger, guard, position
        self.private = job.engine is not None
        self.nonprivate_steps = 0
        self.committed = 0           # steps in the ledger's history (done + ahead), charged excluded
        self.charged: History = []   # steps of earlier processes charged in addition (replay.py)
        self.replayed: History = []  # an earlier process's steps beyond the resume point, which
        self.resumed_at = 0          # this run retakes exactly from step `resumed_at` on

    # -- this process's steps --------------------------------------------------------------------
    def history(self) -> History:
        """Runs of (sigma, q, steps) of the steps done so far (the accountant's record)."""
        return merge_history(self.job.engine.accountant.history) if self.private else []

    def steps(self) -> int:
        """Logical steps done so far (resumed steps included)."""
        return history_steps(self.history()) if self.private else self.nonprivate_steps

    def upcoming(self, count: int) -> History:
        """(sigma, q, 1) of each of the next `count` steps: sigma from the optimizer's noise
        schedule (a pure function of the step index, dptrain.privacy.schedules), q of the
        batches the private loader hands out next (`PrivacyEngine.upcoming_sample_rates`: the
        sampler indexes its schedule by batch, so a batch drawn and never stepped on cannot make
        the committed q and the charged q disagree). The loop steps on every batch it receives,
        so these are exactly the values the accountant will record.
        """
        opt = self.job.optimizer
        start = int(getattr(opt, "steps_taken", 0))
        sigma_at = getattr(opt, "noise_schedule", None) or (lambda _: opt.noise_multiplier)
        rates = self.job.engine.upcoming_sample_rates(count)
        return [(float(sigma_at(start + i)), float(q), 1) for i, q in enumerate(rates)]

    # -- every step the ledger counts ------------------------------------------------------------
    def spent(self, upcoming: History | None = None) -> History:
        """Every step the ledger must count as spent (with `upcoming`: once they have run):
        charged steps of earlier processes, the steps of this run's accountant (resumed steps
        included), then the replayed steps it has not retaken yet."""
        own = self.history() + list(upcoming or [])
        return merge_history(self.charged + with_replayed(own, self.resumed_at, self.replayed))

    def not_retaken(self) -> History:
        """The replayed steps of an earlier process this run has not retaken yet."""
        return steps_after(self.replayed, self.pos.step - self.resumed_at)

    def steps_completed(self) -> int:
        """Steps known to have run: charged ones, this run's logical steps and the replayed
        steps of an earlier process not retaken yet."""
        return (history_steps(self.charged) + self.pos.step
                + history_steps(self.not_retaken()))

    def epsilon(self) -> float | None:
        """Epsilon of every step spent so far (None for a non-private run)."""
        if not self.private:
            return None
        return epsilon_of(self.spent(), self.ledger.data["delta"], self.ledger.data["accountant"],
                          ledger_sampling(self.ledger.data))

    # -- commits and the guard -------------------------------------------------------------------
    def admissible(self, upcoming: History) -> int:
        """How many of `upcoming` (runs of one step each) may run: the retakes of replayed steps
        (already charged), then those the budget guard admits."""
        free = min(len(upcoming), history_steps(self.not_retaken()))
        return free + self.guard.admissible(self.spent(), upcoming[free:])

    def ensure_committed(self, steps_left: float) -> bool:
        """Before the data of step `position.step + 1` is read: make sure it is in the ledger.

        When every committed step has run, commits the next block (at most COMMIT_BLOCK_STEPS
        and `steps_left`, the steps left in the epoch and the run), cut to the steps the budget
        guard admits. Returns False when the budget forbids even the next step.
        """
        if not self.private or self.committed > self.pos.step:
            return True
        block = min(COMMIT_BLOCK_STEPS, steps_left)
        upcoming = self.upcoming(max(1, int(block)))
        admitted = self.admissible(upcoming)
        if admitted == 0:
            return False
        self.ledger.commit(self.spent(upcoming[:admitted]), steps_completed=self.steps_completed())
        self.committed = self.pos.step + admitted
        return True

    def commit_done(self) -> None:
        """Commit exactly the steps spent so far (after a resume restored them)."""
        self.ledger.commit(self.spent(), steps_completed=self.steps_completed())
        self.committed = self.pos.step

    def steps_left(self, settings_max_steps: int | None) -> float:
        """Steps `train.max_steps` leaves to run (inf without it)."""
        return math.inf if settings_max_steps is None else settings_max_steps - self.pos.step

    def state(self) -> dict[str, Any]:
        """The spend a checkpoint records: this process's history and the charged steps."""
        return {"history": self.history(), "charged": self.charged}
