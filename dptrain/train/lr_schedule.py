"""Learning-rate schedules: the rate of each logical step as a pure function of the step.

A schedule multiplies every parameter group's base rate (`optimizer.lr`) by `factor(step,
total_steps)`, where `step` counts the optimizer's logical steps taken (the DP-SGD steps the
accountant charges) and `total_steps` those of the whole run (`train.epochs` times the steps of an
epoch). Since the factor depends on nothing else, a resumed run is back on the same curve; the
checkpoint stores the scheduler's state as well.

* `constant`: factor 1 (the default).
* `linear`: a linear warm-up from 0 to 1 over the warm-up steps, then a linear decay to 0 at
  `total_steps` (the schedule of Li et al. 2022 and of Hugging Face's fine-tuning scripts).
* `cosine`: the same warm-up, then a half cosine from 1 to 0.

The warm-up lasts `warmup_steps` steps, or (when that is null) `warmup_fraction` of the total
steps, rounded down. A schedule is post-processing of the privatised gradients: it reads no
training example, so it costs no privacy (the ledger says so: `LR_SCHEDULE_NOTE`).

Torch-free but for `make_lr_scheduler`, so that the command's typed configs load without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from dptrain.checks import NON_NEGATIVE_INT, Rule, check_fields, is_real, one_of, setting

KINDS = ("constant", "linear", "cosine")
WARMUP_FRACTION = Rule("a number in [0, 1), or null",
                       lambda v: v is None or (is_real(v) and 0 <= v < 1))
LR_SCHEDULE_NOTE = ("post-processing of the privatised gradients: the rate of each step is a "
                    "function of the step count alone, so the schedule costs no privacy")


@dataclass(frozen=True)
class LRSchedule:
    """The `lr_schedule` config group: the shape of the learning rate over a run's steps.

    `warmup_steps` (when not null) wins over `warmup_fraction`; both are ignored by `constant`.
    """

    kind: str = setting("constant", one_of(*KINDS))
    warmup_steps: Optional[int] = setting(None, NON_NEGATIVE_INT.or_none())
    warmup_fraction: Optional[float] = setting(None, WARMUP_FRACTION)

    def __post_init__(self) -> None:
        check_fields(self, LRSchedule, "lr_schedule")

    @classmethod
    def of(cls, value: LRSchedule | dict[str, Any] | None) -> LRSchedule:
        """A schedule from a config mapping (`{"kind": "linear", ...}`), itself, or None (constant)."""
        if value is None:
            return cls()
        if isinstance(value, LRSchedule):
            return value
        return cls(**dict(value))

    def warmup(self, total_steps: int) -> int:
        """The number of warm-up steps of a run of `total_steps` steps (0 for `constant`)."""
        if self.kind == "constant":
            return 0
        if self.warmup_steps is not None:
            return int(self.warmup_steps)
        return int(math.floor((self.warmup_fraction or 0.0) * total_steps))

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base rate at logical step `step` (0 = the first step taken)."""
        if self.kind == "constant":
            return 1.0
        warmup = self.warmup(total_steps)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        decay = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / decay)
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def record(self, total_steps: int) -> dict[str, Any]:
        """The ledger's description: kind, warm-up and total steps, and why it costs nothing."""
        return {"kind": self.kind, "warmup_steps": self.warmup(total_steps),
                "total_steps": int(total_steps), "privacy": LR_SCHEDULE_NOTE}


def make_lr_scheduler(optimizer: Any, schedule: LRSchedule, total_steps: int) -> Any:
    """A `torch.optim.lr_scheduler.LambdaLR` over `optimizer` following `schedule` for a run of
    `total_steps` logical steps, with the ledger's description as its `record` attribute; call
    its `step()` once after each logical step."""
    from torch.optim.lr_scheduler import LambdaLR  # lazy: the config schemas load no torch

    scheduler = LambdaLR(optimizer, lambda step: schedule.factor(step, total_steps))
    # what it follows, as the ledger records it (plain data: saved with the scheduler's state)
    scheduler.record = schedule.record(total_steps)
    return scheduler


def restore_lr_scheduler(scheduler: Any, state: dict[str, Any] | None, step: int) -> None:
    """Set a resumed run's `scheduler` to the checkpoint's `state`; for a checkpoint saved
    without one, to the rate of logical step `step` (the schedule is a function of the step)."""
    if state is not None:
        scheduler.load_state_dict(state)
        return
    scheduler.last_epoch = step - 1
    scheduler.step()
