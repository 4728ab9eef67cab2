"""What a private run is made of: a `TrainingJob` (live objects), `TrainSettings` (plain values),
and what it reports (`RunResult`); the run's position and evaluations.

The command builds a job from its config (dptrain.cli.build); from Python, `private_job` makes
one from the objects `PrivacyEngine.make_private` returned. `dptrain.train.train(job, settings)`
runs it. Nothing here imports Hydra: a config travels as a plain dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from dptrain.errors import ConfigError
from dptrain.losses import LossStep, ModelLoss
from dptrain.privacy.plan import PerformanceSettings, PrivacyPlan
from dptrain.train.settings import TrainConfig, TrainSettings  # noqa: F401  (part of the job)


@dataclass
class PrivacySettings:
    """The run's privacy as the ledger and the budget guard need it: its plan (None for the
    non-private baseline, privacy=none: no engine, and the ledger says so) and the settings that
    compute it (`performance`)."""

    enabled: bool
    plan: PrivacyPlan | None = None
    performance: PerformanceSettings = field(default_factory=PerformanceSettings)

    @property
    def target_epsilon(self) -> float | None:
        """The budget: the calibration target (privacy=epsilon) or a cap (None: no cap)."""
        return None if self.plan is None else self.plan.noise.target_epsilon

    @property
    def target_delta(self) -> float | None:
        """The delta epsilon is reported at (None when non-private)."""
        return None if self.plan is None else self.plan.delta

    @property
    def secure_mode(self) -> bool:
        return self.plan is not None and self.plan.secure

    @classmethod
    def of_engine(cls, engine: Any, *, target_epsilon: float | None = None,
                  target_delta: float | None = None) -> PrivacySettings:
        """The settings of what `engine.make_private` built: its plan, with a budget cap
        `target_epsilon` and the reporting delta `target_delta` when given."""
        plan = engine.plan
        if target_epsilon is not None:
            plan = dataclasses.replace(plan, noise=dataclasses.replace(
                plan.noise, target_epsilon=target_epsilon))
        if target_delta is not None:
            plan = dataclasses.replace(plan, delta=target_delta)
        return cls(enabled=True, plan=plan, performance=engine.performance)


@dataclass
class TrainingJob:
    """Live objects of one run, built from the config and ready to train.

    For a private run, `model`, `optimizer` and `train_loader` are the outputs of
    `PrivacyEngine.make_private` and `engine` is that engine; otherwise `engine` is None.

    A batch (`dptrain.batches`) is an `(x, y)` pair or a mapping of tensors with `labels`
    (Hugging Face inputs: `input_ids`, `attention_mask`, `labels`). `loss_step(model, batch)`
    returns each example's loss `[B]` (`dptrain.losses`); the training loop, its physical chunks
    and evaluation all go through it (`step_loss`). None: `ModelLoss(loss_fn)`, the model on
    the batch's inputs and `loss_fn` per example (cross-entropy with reduction none by default).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_loader: torch.utils.data.DataLoader
    test_loader: torch.utils.data.DataLoader | None
    # loss_fn(output, target): the default loss step's (ModelLoss), unless loss_step is set
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    engine: Any | None                       # dptrain.PrivacyEngine or None
    privacy: PrivacySettings
    dataset_name: str
    dataset_size: int                        # N, the number of training examples
    config: dict[str, Any]                   # the fully resolved config (for the ledger and its hash)
    precision: str = "fp32"                  # "fp32" | "bf16" (autocast)
    # Examples held out of the training split (dataset.validation_size; not in dataset_size):
    # evaluated with the test split, and the only split train.keep_best may select on.
    validation_loader: torch.utils.data.DataLoader | None = None
    # Preprocessing that read the training examples' contents (DatasetSplits.private_preprocessing),
    # one sentence each: recorded in the ledger as not covered by epsilon.
    private_preprocessing: list[str] = field(default_factory=list)
    synthetic: bool = False                  # seeded random data (dataset.synthetic=true)
    # A torch LR scheduler stepped once per logical step; None: the loop builds one from
    # `TrainSettings.lr_schedule` (none for a constant rate). Saved in checkpoints.
    lr_scheduler: Any | None = None
    # The secret key that chose the rows dataset.max_samples keeps and dataset.validation_size
    # holds out (DatasetSplits.split_key): saved in checkpoints only (private resume state),
    # where a resume reads it back to train on the same rows; never in the ledger or the repr.
    split_key: bytes | None = field(default=None, repr=False)
    # loss_step(model, batch) -> Tensor[B] or StepLosses; None: ModelLoss(loss_fn)
    loss_step: LossStep | None = None

    @property
    def step_loss(self) -> LossStep:
        """The loss step the loop and evaluation run: `loss_step`, else `ModelLoss(loss_fn)`."""
        return self.loss_step if self.loss_step is not None else ModelLoss(self.loss_fn)


# The file the `dptrain` command writes a job's RunResult to, in its run folder
# (dptrain.cli.results).
RESULT_FILENAME = "result.json"


@dataclass
class RunResult:
    """What a finished (or stopped) run reports back to the CLI and the sweep summary."""

    status: str          # "completed" | "stopped_at_budget" | "interrupted" (Ctrl-C) |
                         # "preempted" (SIGTERM / SIGUSR1) | "failed"
    steps: int
    epochs_completed: int
    epsilon: float | None                    # None for a non-private run
    delta: float | None
    test_accuracy: float | None
    test_loss: float | None
    run_dir: Path
    val_accuracy: float | None = None        # last evaluation on dataset.validation_size's split
    val_loss: float | None = None            # (None without a validation split)
    test_perplexity: float | None = None     # exp(mean cross-entropy per token): token losses only
    val_perplexity: float | None = None
    # `steps` counts the logical steps behind the model the run ends with; `steps_charged` the
    # steps its ledger charges (None for a non-private run): every process's, so more than
    # `steps` after a resume from an older checkpoint or a crash (steps taken, not retaken)
    steps_charged: int | None = None

    @property
    def selection_accuracy(self) -> float | None:
        """The accuracy to compare runs by (see :func:`selection_accuracy`)."""
        return selection_accuracy(self.val_accuracy, self.test_accuracy)


def selection_accuracy(val_accuracy: float | None, test_accuracy: float | None) -> float | None:
    """The accuracy to compare runs by: validation when the run has a split, else test."""
    return test_accuracy if val_accuracy is None else val_accuracy


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a run: its ledger says "interrupted" and keeps every step it
    committed; `result` is what the run had done (steps, epsilon so far, last evaluation)."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(f"interrupted after {result.steps} steps")
        self.result = result


class RunPreempted(RunInterrupted):
    """SIGTERM or SIGUSR1 (a scheduler's preemption) stopped a run after a whole step: the
    ledger says "preempted", `checkpoints/last.pt` holds the state after that step, and
    `result` is what the run had done. `signum` is the signal's number, `signal_name` its name."""

    def __init__(self, result: RunResult, signum: int, signal_name: str) -> None:
        super().__init__(result)
        self.signum, self.signal_name = signum, signal_name


@dataclass(frozen=True)
class Evaluation:
    """The model's loss and accuracy after logical step `step`, on the test split and (None
    without one) on the validation split held out of the training data; the perplexity too when
    the loss is over tokens (a causal LM; else None)."""

    step: int
    test_loss: float | None
    test_accuracy: float | None
    val_loss: float | None = None
    val_accuracy: float | None = None
    test_perplexity: float | None = None
    val_perplexity: float | None = None

    def metrics(self, validated: bool) -> dict[str, float | None]:
        """The metrics record's fields: test_loss, test_accuracy (+ val_loss, val_accuracy), and
        test_perplexity (+ val_perplexity) when the loss is over tokens. The val_* ones are
        private (not covered by epsilon): the loggers keep them apart (`split_private`)."""
        out = {"test_loss": self.test_loss, "test_accuracy": self.test_accuracy}
        if validated:
            out.update(val_loss=self.val_loss, val_accuracy=self.val_accuracy)
        if self.test_perplexity is not None or self.val_perplexity is not None:
            out["test_perplexity"] = self.test_perplexity
            if validated:
                out["val_perplexity"] = self.val_perplexity
        return out


@dataclass
class Position:
    """Where a run is: logical steps done, epochs completed, steps into the current epoch (one
    object shared by the run's collaborators, updated in place)."""

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    best_val_accuracy: float | None = None   # of the checkpoint saved as best.pt
    last_eval: Evaluation | None = None
    stopped_at_budget: bool = False


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a GradSampleModule (or the model itself)."""
    return getattr(model, "_module", model)


def check_model_selection(keep_best: bool, has_validation: bool) -> None:
    """ConfigError for train.keep_best=true without a validation split (dataset.validation_size).

    Choosing the best checkpoint on the test split would bias the test accuracy it reports.
    """
    if keep_best and not has_validation:
        raise ConfigError(
            "train.keep_best=true needs a validation split to choose the best checkpoint on: "
            "picking it on the test split would make its reported test accuracy optimistic. "
            "Hold out training examples with dataset.validation_size (a count, or a fraction "
            "such as 0.1; they are then not trained on and not counted in N), or set "
            "train.keep_best=false.")


def private_job(engine: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                train_loader: torch.utils.data.DataLoader, *,
                test_loader: torch.utils.data.DataLoader | None = None,
                validation_loader: torch.utils.data.DataLoader | None = None,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
                target_epsilon: float | None = None, target_delta: float | None = None,
                dataset_name: str = "data", config: dict[str, Any] | None = None,
                device: torch.device | str | None = None, precision: str = "fp32",
                split_key: bytes | None = None,
                loss_step: LossStep | None = None) -> TrainingJob:
    """A TrainingJob of what `engine.make_private(...)` returned, for `dptrain.train.train`.

    `target_epsilon` (optional) is the budget the run may not exceed; `target_delta` the delta
    epsilon is reported at (default: 1/(10 N) rounded down to a power of ten). `config`
    describes the run in the ledger, and a resume must present the same one (default: the
    privacy settings and the dataset). `device` defaults to the model's. `split_key`: the
    `DatasetSplits.split_key` of data from `dptrain.data.datasets.load_dataset`, saved in the
    checkpoints so that a resume can load the same rows (`load_dataset(...,
    split_key=dptrain.train.checkpoint.saved_split_key(path))`). `loss_step(model, batch) ->
    Tensor[B]`: each example's loss on a batch (None: the model on the batch's inputs and
    `loss_fn` per example; see TrainingJob).
    """
    privacy = PrivacySettings.of_engine(engine, target_epsilon=target_epsilon,
                                        target_delta=target_delta)
    size = int(engine.dataset_size)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if config is None:
        config = {"dataset": {"name": dataset_name, "size": size},
                  "privacy": privacy.plan.to_dict()}
    return TrainingJob(model=model, optimizer=optimizer, train_loader=train_loader,
                       test_loader=test_loader, loss_fn=loss_fn, device=torch.device(device),
                       engine=engine, privacy=privacy, dataset_name=dataset_name,
                       dataset_size=size, config=config, precision=precision,
                       validation_loader=validation_loader, split_key=split_key,
                       loss_step=loss_step)
