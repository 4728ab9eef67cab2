"""Preemption: SIGTERM and SIGUSR1 stop a run at the next step boundary, checkpointed.

Schedulers preempt a job by signal: SLURM, Kubernetes and most others send SIGTERM and kill the
process a grace period later; SLURM sends SIGUSR1 ahead of a time limit when asked
(`#SBATCH --signal=USR1@120`). While a run trains, the first such signal only sets a flag: the run
finishes the step it is in (a step is either wholly taken and charged, or not started), writes
`checkpoints/last.pt`, marks the ledger "preempted" and raises RunPreempted. A second signal of
either kind stops at once, like Ctrl-C (the ledger keeps every committed step; the run resumes
from its last checkpoint).

Under torch.distributed every rank must stop after the same step, or the others would wait
forever in the next all-reduce: `requested()` agrees on the flag across ranks (one tiny
all-reduce per step).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

# The signals that preempt a run, with the names the messages and the ledger use.
PREEMPTING_SIGNALS: dict[int, str] = {signal.SIGTERM: "SIGTERM"}
if hasattr(signal, "SIGUSR1"):
    PREEMPTING_SIGNALS[signal.SIGUSR1] = "SIGUSR1"


class StopNow(KeyboardInterrupt):
    """A second preempting signal: stop at once, as Ctrl-C does."""


class Preemption:
    """The preempting signal received so far (None until one arrives)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def name(self) -> str:
        """The received signal's name ("SIGTERM", "SIGUSR1"); "" before any."""
        return "" if self.signum is None else PREEMPTING_SIGNALS.get(self.signum, str(self.signum))

    def requested(self) -> bool:
        """True once a preempting signal arrived on this process (on any rank under
        torch.distributed: every rank then answers True after the same step)."""
        local = self.signum is not None
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not local and int(flag.item()):
            self.signum = int(flag.item())
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise StopNow()
        self.signum = signum
        sys.stderr.write(f"dptrain: {self.name} received: stopping after this step and writing a "
                         "checkpoint (send it again to stop at once).\n")
        sys.stderr.flush()

    @contextlib.contextmanager
    def installed(self) -> Iterator[Preemption]:
        """Handle the preempting signals inside the block (main thread only: elsewhere Python
        cannot install handlers, and the signals keep their previous behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous: dict[int, Any] = {}
        try:
            for signum in PREEMPTING_SIGNALS:
                previous[signum] = signal.signal(signum, self._handle)
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by `signum`: 128 + signum (143 for SIGTERM, 138 for
    SIGUSR1), what a shell reports for a process the signal ended, so schedulers and wrappers
    that requeue on that status see a preempted job."""
    return 128 + int(signum)
