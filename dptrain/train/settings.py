"""The settings of a run's loop: the `train` config group, checked on construction.

Torch-free, so that the command's typed configs (dptrain.cli.schema, which uses `TrainConfig` as
the schema of `train`) load without torch.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dptrain.checks import (
    BOOLEAN,
    EVERY_EPOCHS,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    Rule,
    field_rules,
    setting,
)
from dptrain.errors import ConfigError
from dptrain.train.lr_schedule import LRSchedule

# The rule that sizes a run from its number of training examples N (train.batch_size and
# train.epochs null; model=hf sets both so): the expected batch is 2 sqrt(N) rounded to a power
# of two within [16, 1024] (and at most N), and the epochs give about TARGET_STEPS logical steps,
# at least 3 and at most 20. N = 300: batch 32, 11 epochs (103 steps); N = 67,349 (SST-2):
# batch 512, 3 epochs (394 steps). docs/transformers.md says why.
MIN_BATCH, MAX_BATCH = 16, 1024
TARGET_STEPS, MIN_EPOCHS, MAX_EPOCHS = 100, 3, 20


def sized_for(num_examples: int) -> tuple[int, int]:
    """(batch_size, epochs) of the sizing rule for `num_examples` training examples (N >= 1)."""
    n = max(1, int(num_examples))
    power = 2 ** round(math.log2(2 * math.sqrt(n)))
    batch = min(n, max(MIN_BATCH, min(MAX_BATCH, power)))
    epochs = min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(TARGET_STEPS * batch / n)))
    return batch, epochs


# How a message names a run setting: by its config key under the `dptrain` command (which sets
# this, `command_line_names`), by the Python argument that sets it otherwise.
_COMMAND_LINE_NAMES: ContextVar[bool] = ContextVar("command_line_names", default=False)
# config key -> (the Python call, its argument) for the keys whose names differ; any other
# `train.X` is `TrainSettings(X=...)`.
_PYTHON_ARGUMENTS = {
    "hydra.run.dir": ("TrainSettings", "run_dir"),
    "privacy.target_epsilon": ("private_job", "target_epsilon"),
    "privacy.secure_mode": ("PrivacyEngine", "secure_mode"),
}


@contextlib.contextmanager
def command_line_names() -> Iterator[None]:
    """Within the block, messages name settings by their config keys (`setting_name`)."""
    token = _COMMAND_LINE_NAMES.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE_NAMES.reset(token)


def setting_name(key: str, value: Any = None) -> str:
    """How a message names the setting of config key `key` (e.g. "train.resume"), with `value`
    when given: `train.resume=auto` under the command, `TrainSettings(resume='auto')` from
    Python (`TrainSettings.resume` without a value)."""
    if _COMMAND_LINE_NAMES.get():
        return key if value is None else f"{key}={_shown(value)}"
    call, argument = _PYTHON_ARGUMENTS.get(key, ("TrainSettings", key.partition(".")[2]))
    return f"{call}.{argument}" if value is None else f"{call}({argument}={value!r})"


def _shown(value: Any) -> str:
    """A value as an override writes it: true / false for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)


RESUME = Rule("a checkpoint path or auto (the newest checkpoint of the run folder), or null",
              lambda v: v is None or isinstance(v, str))


@dataclass
class TrainConfig:
    """The `train` config group: the loop's settings, each checked on construction.

    Also the schema of the `train` section of the CLI's config (`dptrain.cli.schema`): the field
    types are what the command accepts, the rules (`dptrain.checks.setting`) what values.
    """

    # null in the command's config: chosen from the number of training examples (`sized_for`)
    epochs: Optional[int] = setting(rule=POSITIVE_INT)
    batch_size: Optional[int] = setting(rule=POSITIVE_INT)  # the expected logical batch
    max_physical_batch_size: Optional[int] = setting(None, POSITIVE_INT.or_none())
    seed: int = setting(0, NON_NEGATIVE_INT)
    eval_every: int = setting(1, EVERY_EPOCHS)           # epochs between evaluations
    checkpoint_every: int = setting(1, EVERY_EPOCHS)     # epochs between checkpoints
    keep_best: bool = setting(False, BOOLEAN)            # also keep best.pt by validation accuracy
    # the newest k epoch_N.pt checkpoints are kept (last.pt and best.pt always); null: all
    keep_checkpoints: Optional[int] = setting(2, NON_NEGATIVE_INT.or_none())
    resume: Optional[str] = setting(None, RESUME)        # a checkpoint path, "auto", or None
    max_steps: Optional[int] = setting(None, POSITIVE_INT.or_none())  # stop after this many steps
    progress: bool = setting(True, BOOLEAN)              # rich progress bars
    # another process holds the run folder: wait for it (true) or stop at once (false)
    wait_for_lock: bool = setting(False, BOOLEAN)

    def __post_init__(self) -> None:
        if isinstance(self.resume, os.PathLike):
            self.resume = os.fspath(self.resume)
        for name, rule in field_rules(TrainConfig).items():
            rule.check(getattr(self, name), setting_name(f"train.{name}"))
        physical, batch = self.max_physical_batch_size, self.batch_size
        if physical is not None and physical > batch:
            chunk, logical = (setting_name("train.max_physical_batch_size"),
                              setting_name("train.batch_size"))
            raise ConfigError(
                f"{chunk}={physical} is larger than {logical}={batch}: physical chunks split a "
                f"logical batch, so set {chunk}<={batch} (or None / null to process each logical "
                "batch at once)."
            )


@dataclass(kw_only=True)
class TrainSettings(TrainConfig):
    """The loop settings of one run: the `train` group, the run folder and the learning-rate
    schedule (the `lr_schedule` group: an `LRSchedule`, a mapping of its fields, or None for a
    constant rate)."""

    run_dir: Path
    lr_schedule: Optional[LRSchedule] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.run_dir = Path(self.run_dir)
        self.lr_schedule = LRSchedule.of(self.lr_schedule)

    def finished(self, position: Any) -> bool:
        """True when a run at `position` has nothing left to train (every epoch, or max_steps)."""
        return position.epoch >= self.epochs or self.stop_requested(position)

    def stop_requested(self, position: Any) -> bool:
        """True when `train.max_steps` steps are done."""
        return self.max_steps is not None and position.step >= self.max_steps
