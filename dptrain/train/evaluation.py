"""Evaluation: the loss and accuracy (perplexity for a loss over tokens) of a model on a split,
and the evaluations of a run.

`evaluate` runs under no_grad with the model in eval mode and leaves every global RNG untouched,
so evaluating never changes the training trajectory (resume stays exact). `Evaluator` evaluates
the job's test and validation splits at the run's position and decides, with `train.keep_best`,
when a state beats every earlier one on validation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dptrain.batches import rows, to_device
from dptrain.losses import StepLosses, step_losses
from dptrain.train.job import Evaluation, Position, TrainingJob
from dptrain.train.settings import TrainSettings


def _correct(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """Correct predictions in a batch (0-dim tensor, no device sync): argmax of logits [B, K]
    (K > 1) against integer labels [B]; the sign of a single logit [B] or [B, 1] against 0/1
    labels; None for soft labels and for per-token targets [B, T] (a language model: no
    per-sample accuracy; its evaluation reports the perplexity)."""
    if output.dim() >= 2 and output.shape[-1] > 1:
        if target.is_floating_point() or target.dim() > 1:
            return None
        return (output.argmax(dim=-1) == target).sum()
    return ((output.reshape(target.shape) > 0).long() == target.long()).sum()


@dataclass
class Tally:
    """Running sums of loss (weighted by samples) and correct predictions; for a loss over tokens
    also of the cross-entropy over every counted token and their number (`add_tokens`).

    Sums stay tensors on the model's device, so no step waits for the accelerator; reading
    `loss`, `accuracy` or `perplexity` synchronizes.
    """

    loss_sum: torch.Tensor | float = 0.0
    correct: torch.Tensor | int = 0
    samples: int = 0
    has_accuracy: bool = True
    token_nll: torch.Tensor | float = 0.0
    tokens: torch.Tensor | int = 0
    #: examples left out of the clipped sums for a gradient that is not finite (private)
    nonfinite: torch.Tensor | int = 0

    def add(self, losses: StepLosses, samples: int) -> None:
        """A batch of `samples` examples: its losses (`[B]` per example, or a 0-dim batch mean
        of a loss function of the earlier contract, `dptrain.losses.per_example_losses`) and,
        when the step gave them, its output and targets (the accuracy; without them the tally
        has none)."""
        if samples == 0:
            return
        # the batch's mean rounded to float32, as earlier versions reported it (`loss.float()`):
        # runs whose weights differ by round-off only (DDP and one process) log equal losses
        mean = losses.losses.detach().float().mean()
        self.loss_sum = self.loss_sum + mean.double() * samples
        right = None if losses.output is None or losses.target is None else \
            _correct(losses.output.detach(), losses.target)
        self.has_accuracy &= right is not None
        if right is not None:
            self.correct = self.correct + right
        self.samples += samples

    @property
    def loss(self) -> float | None:
        return float(self.loss_sum) / self.samples if self.samples else None

    def add_tokens(self, nll: torch.Tensor, tokens: torch.Tensor) -> None:
        """A batch's summed token cross-entropy (nats) and its number of counted tokens."""
        self.token_nll = self.token_nll + nll.detach().double()
        self.tokens = self.tokens + tokens.detach()

    @property
    def accuracy(self) -> float | None:
        return int(self.correct) / self.samples if self.samples and self.has_accuracy else None

    @property
    def perplexity(self) -> float | None:
        """exp(cross-entropy per counted token); None without any token (not a token loss)."""
        tokens = int(self.tokens)
        return math.exp(float(self.token_nll) / tokens) if tokens else None


def autocast(job: TrainingJob) -> contextlib.AbstractContextManager:
    """bf16 autocast when job.precision == "bf16", else a no-op."""
    if job.precision == "bf16":
        return torch.autocast(device_type=job.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def score(job: TrainingJob, loader: Iterable[Any] | None,
          on_batch: Callable[[], None] | None = None) -> Tally:
    """The tally of the model on `loader` (job.test_loader or job.validation_loader; an empty
    tally without one): loss and accuracy of the job's loss step (`job.step_loss`, over `(x, y)`
    or mapping batches), and the perplexity when that step is over tokens (it has
    `token_sums(output, target)`: the default step over a `dptrain.TokenLoss`). `on_batch` is
    called after each batch (progress).

    Runs under no_grad with the model in eval mode and leaves every global RNG untouched, so
    evaluating never changes the training trajectory (resume stays exact).
    """
    tally = Tally()
    if loader is None:
        return tally
    loss_step = job.step_loss
    token_sums = getattr(loss_step, "token_sums", None)
    was_training = job.model.training
    job.model.eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for batch in loader:
            batch = to_device(batch, job.device)
            with autocast(job):
                losses = step_losses(loss_step, job.model, batch)
            tally.add(losses, rows(batch) or 0)
            if callable(token_sums) and losses.output is not None:
                tally.add_tokens(*token_sums(losses.output, losses.target))
            if on_batch is not None:
                on_batch()
    job.model.train(was_training)
    clear = getattr(job.model, "clear_per_sample", None)
    if callable(clear):
        clear()
    return tally


def evaluate(job: TrainingJob, loader: Iterable[Any] | None) -> tuple[float | None, float | None]:
    """(mean loss, accuracy) of the model on `loader`; (None, None) without one (`score`)."""
    tally = score(job, loader)
    return tally.loss, tally.accuracy


class EvaluationProgress(Protocol):
    """Where an evaluation shows its progress (dptrain.train.display.Display.evaluation)."""

    def evaluation(self, split: str, total: int | None
                   ) -> contextlib.AbstractContextManager[Callable[[], None]]: ...


class Evaluator:
    """Evaluates the job at the run's position; keeps `position.last_eval` and the best."""

    def __init__(self, job: TrainingJob, settings: TrainSettings, position: Position,
                 progress: EvaluationProgress | None = None) -> None:
        self.job, self.settings, self.pos, self.progress = job, settings, position, progress

    def evaluate(self) -> None:
        """Evaluate the test and validation splits now (position.last_eval)."""
        test = self._split("test", self.job.test_loader)
        val = self._split("validation", self.job.validation_loader)
        self.pos.last_eval = Evaluation(self.pos.step, test.loss, test.accuracy, val.loss,
                                        val.accuracy, test.perplexity, val.perplexity)

    def _split(self, name: str, loader: Any) -> Tally:
        if loader is None or self.progress is None:
            return score(self.job, loader)
        with self.progress.evaluation(name, _length(loader)) as on_batch:
            return score(self.job, loader, on_batch)

    def current(self) -> bool:
        """True when the last evaluation is of the current step."""
        return self.pos.last_eval is not None and self.pos.last_eval.step == self.pos.step

    def metrics(self) -> dict[str, float | None]:
        """The last evaluation's metrics record fields (validation ones with a validation
        split)."""
        return self.pos.last_eval.metrics(validated=self.job.validation_loader is not None)

    def is_new_best(self) -> bool:
        """With keep_best: True (and remembered) when this step's validation accuracy beats every
        earlier one (train.keep_best needs a validation split: `check_model_selection`)."""
        if not self.settings.keep_best or not self.current():
            return False
        acc, best = self.pos.last_eval.val_accuracy, self.pos.best_val_accuracy
        if acc is None or (best is not None and acc <= best):
            return False
        self.pos.best_val_accuracy = acc
        return True


def _length(loader: Any) -> int | None:
    """The number of batches of `loader`, None when it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None
