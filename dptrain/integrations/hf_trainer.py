"""A Hugging Face `transformers.Trainer` made private: `PrivateTrainer` and `PrivacyArguments`.

    from dptrain.integrations.hf_trainer import PrivacyArguments, PrivateTrainer

    trainer = PrivateTrainer(model=model, args=training_args, train_dataset=train,
                             data_collator=collator,
                             privacy=PrivacyArguments(target_epsilon=8.0, max_grad_norm=1.0))
    trainer.train()            # DP-SGD; privacy_ledger.json in training_args.output_dir

The subclass overrides the Trainer's documented extension points only, and hands the mechanism
to `dptrain.PrivacyEngine.make_private` (the public API):

- `get_train_dataloader`: the Trainer's own loader (its column removal and collator) rebuilt by
  make_private around our `PoissonBatchSampler`: one logical batch per step, each example in it
  with probability q = per_device_train_batch_size * gradient_accumulation_steps / N. The
  Trainer's RandomSampler (and its shuffling) is never iterated.
- `create_optimizer`: the Trainer's optimizer wrapped in the `DPOptimizer` (per-sample clipping,
  Gaussian noise once per logical batch, the accountant stepped with the sigma and q used).
- `training_step`: one logical batch split into physical chunks of
  `per_device_train_batch_size` rows, each chunk's per-sample gradients clipped and summed
  (dptrain.privacy.step.accumulate_chunks, private_step's chunk loop); the Trainer's single
  `optimizer.step()` releases the batch (noise once, charged at its record's q). The Trainer itself runs with gradient_accumulation_steps=1
  (on a copy of its arguments): its "step" is exactly one noisy step.
- `compute_loss`: one loss per example (`default_per_example_loss`, or the caller's), so that
  each example's gradient depends on that example alone (HF's causal LM loss averages over the
  batch's tokens; see dptrain.losses).
- `train` / `log`: the privacy ledger (dptrain.train.ledger, with the run loop's PrivacySpend and
  BudgetGuard): steps committed before their batch reaches the Trainer, the final epsilon after
  training, "failed" / "interrupted" on a crash or Ctrl-C (charging every step whose batch was
  drawn, and saying so in a warning: `_stopped_history`); epsilon added to the Trainer's logs.

Settings under which the Trainer's own sampling or accumulation would change the sampling rate the
ledger charges are refused (`check_training_arguments`). transformers is imported by this module
only; dptrain never imports it.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from dptrain.accounting import get_noise_multiplier
from dptrain.accounting.calibration import steps_per_epoch
from dptrain.accounting.history import History, history_steps, truncate_history
from dptrain.checks import (
    check_delta,
    check_epsilon,
    check_max_grad_norm,
    check_noise_multiplier,
    default_delta,
)
from dptrain.batches import rows as batch_rows
from dptrain.errors import BudgetExhaustedError, ConfigError
from dptrain.formatting import format_epsilon
from dptrain.io import ensure_writable_dir, json_safe
from dptrain.losses import per_sample_token_losses
from dptrain.privacy.engine import GRAD_SAMPLE_MODES, PrivacyEngine
from dptrain.privacy.step import accumulate_chunks
from dptrain.train.budget import BudgetGuard, PrivacySpend
from dptrain.train.job import Position, private_job
from dptrain.train.ledger import (
    LEDGER_FILENAME,
    charged_beyond_completed,
    refresh_layer_strategies,
    run_ledger,
)
from dptrain.train.settings import TrainSettings, sized_for

PerExampleLoss = Callable[[Any, Tensor], Tensor]
log = logging.getLogger(__name__)


@dataclass
class PrivacyArguments:
    """The mechanism of a `PrivateTrainer` (checked on construction).

    Exactly one of `noise_multiplier` (sigma) and `target_epsilon` (sigma calibrated so that the
    Trainer's planned steps, `max_steps` or `num_train_epochs`, spend it at `delta`; the run then
    also stops before exceeding it). `max_grad_norm` is C, the per-example clipping bound (the
    Trainer's own `max_grad_norm` has no effect: it would clip the batch gradient, which a private
    run never forms). `delta` defaults to 1/(10 N) rounded down to a power of ten. `seed` and
    `reproducible_mechanism=True` make the noise and the Poisson batches repeat from the seed: an
    opt-in for tests, NOT a guarantee if the seed is known.
    """

    max_grad_norm: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    accountant: str = "prv"                  # "prv" | "rdp" | "gdp"
    grad_sample_mode: str = "hooks"          # "hooks" | "ghost"
    clipping: str = "flat"                   # "flat" | "per_layer" | "adaptive"
    secure_mode: bool = False
    seed: int | None = None
    reproducible_mechanism: bool = False

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError(
                "PrivacyArguments needs exactly one of noise_multiplier (sigma, the noise "
                "multiplier) and target_epsilon (sigma calibrated to spend that epsilon over the "
                f"Trainer's planned steps); got noise_multiplier={self.noise_multiplier!r} and "
                f"target_epsilon={self.target_epsilon!r}.")
        if self.noise_multiplier is not None:
            self.noise_multiplier = check_noise_multiplier(self.noise_multiplier)
        if self.target_epsilon is not None:
            self.target_epsilon = check_epsilon(self.target_epsilon, "target_epsilon", target=True)
        if self.delta is not None:
            self.delta = check_delta(self.delta, "delta")
        check_max_grad_norm(self.max_grad_norm, per_layer=self.clipping == "per_layer")
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ConfigError(f"PrivacyArguments(grad_sample_mode={self.grad_sample_mode!r}) is "
                              f"unknown: use one of {list(GRAD_SAMPLE_MODES)}.")


def _refusal(setting: str, why: str, fix: str) -> ConfigError:
    """One paragraph: which Trainer setting is refused, why it would change what the ledger
    charges, and what to do instead."""
    return ConfigError(f"PrivateTrainer cannot run with {setting}: {why} The privacy ledger would "
                       f"then charge a sampling rate the run did not use. {fix}")


def check_training_arguments(args: Any, trainer: type) -> None:
    """ConfigError (one paragraph) for every TrainingArguments setting, or Trainer override, that
    would let the Trainer's own sampling, batching or accumulation change the sampling rate:
    a length-grouped or other non-random sampling strategy, dropping the last batch, an automatic
    batch size, several devices, fp16 loss scaling, DeepSpeed or FSDP, and a subclass replacing
    the train sampler or dataloader."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy not in ("random", None):
        raise _refusal(f"train_sampling_strategy={strategy!r} (or group_by_length=True)",
                       "the Trainer's sampler orders or groups the examples itself, while a "
                       "private run draws every logical batch by Poisson sampling (each example "
                       "independently with probability q).",
                       "Leave train_sampling_strategy at 'random' (it is replaced by Poisson "
                       "sampling).")
    if args.dataloader_drop_last:
        raise _refusal("dataloader_drop_last=True", "dropping a batch would skip examples the "
                       "accountant counts as sampled.", "Set dataloader_drop_last=False.")
    if args.auto_find_batch_size:
        raise _refusal("auto_find_batch_size=True", "a batch size changed on the fly changes q "
                       "after sigma was chosen for it.", "Set per_device_train_batch_size (the "
                       "physical chunk) and gradient_accumulation_steps yourself.")
    if args.world_size > 1 or args.n_gpu > 1:
        raise _refusal(f"{max(args.world_size, args.n_gpu)} devices",
                       "each device would sample its own batches and the gradients be averaged "
                       "across them, a mechanism this integration does not account for.",
                       "Train on one device (CUDA_VISIBLE_DEVICES=0), or use dptrain's own loop "
                       "(hardware=ddp) for several.")
    if args.fp16:
        raise _refusal("fp16=True", "fp16 loss scaling skips steps whose gradients overflow, after "
                       "their batch was drawn.", "Use bf16=True (no loss scaling) or float32.")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise _refusal("DeepSpeed or FSDP", "they shard and reduce gradients outside the private "
                       "optimizer.", "Train on one device without them.")
    for method in ("_get_train_sampler", "get_train_dataloader", "training_step"):
        if getattr(trainer, method) is not getattr(PrivateTrainer, method):
            raise _refusal(f"{trainer.__name__}.{method} overridden", "a custom train sampler, "
                           "dataloader or training step replaces the Poisson batches or the "
                           "per-example clipping of PrivateTrainer.",
                           "Keep PrivateTrainer's methods; pass per_example_loss= to change the "
                           "loss.")


def check_logical_batch(chunk: int, accumulation: int, num_samples: int, world: int = 1) -> None:
    """ConfigError (one paragraph) when the logical batch, `per_device_train_batch_size *
    gradient_accumulation_steps` (the caller's values; times the `world` size when distributed),
    exceeds the `num_samples` training examples: its sampling rate q = batch / N would exceed 1,
    which no Poisson sampling has. The fix names the two fields and the logical batch and epochs
    of dptrain's sizing rule for N (`dptrain.train.settings.sized_for`), in chunks of at most the
    caller's `per_device_train_batch_size`."""
    logical = chunk * accumulation * world
    if logical <= num_samples:
        return
    batch, epochs = sized_for(num_samples)
    fit_chunk = min(chunk, batch)
    worlds = f" x world size {world}" if world > 1 else ""
    raise ConfigError(
        f"PrivateTrainer cannot sample a logical batch of {logical} examples "
        f"(TrainingArguments.per_device_train_batch_size={chunk} x "
        f"gradient_accumulation_steps={accumulation}{worlds}) from a train_dataset of "
        f"{num_samples} rows: its sampling rate q = {logical}/{num_samples} = "
        f"{logical / num_samples:.2f} would exceed 1 (each step draws each example with "
        f"probability q). Make per_device_train_batch_size * gradient_accumulation_steps at most "
        f"{num_samples}; dptrain's sizing rule for {num_samples} examples is a logical batch of "
        f"{batch} over {epochs} epochs, e.g. per_device_train_batch_size={fit_chunk}, "
        f"gradient_accumulation_steps={max(1, batch // fit_chunk)}, num_train_epochs={epochs} "
        "(docs/hf-trainer.md).")


def _check_trainer_arguments(kwargs: dict[str, Any]) -> None:
    """ConfigError for the Trainer arguments a private run cannot honour: a batch loss
    (`compute_loss_func`) and a model factory for hyperparameter search (`model_init`)."""
    if kwargs.get("compute_loss_func") is not None:
        raise ConfigError("PrivateTrainer(compute_loss_func=...) is not supported: it returns a "
                          "batch loss, and DP-SGD needs one loss per example. Pass "
                          "per_example_loss=fn(model, outputs, labels) -> Tensor[B] instead.")
    if kwargs.get("model_init") is not None:
        raise ConfigError("PrivateTrainer(model_init=...) is not supported: it serves "
                          "hyperparameter_search, whose every trial trains on the same private "
                          "data and spends privacy that one ledger would not charge. Pass model= "
                          "and run one PrivateTrainer (one output_dir) per trial.")


def _is_causal_lm(model: nn.Module) -> bool:
    """True for a causal language model (labels are the inputs, shifted inside the loss): its
    class, or a PEFT model's base class, is one of transformers' causal LM heads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    name = type(base).__name__
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith("ForCausalLM")


def default_per_example_loss(model: nn.Module, outputs: Any, labels: Tensor) -> Tensor:
    """Each example's own loss, [B]: cross-entropy of sequence-classification logits [B, K] (mean
    squared error for one output and float labels); for token logits [B, T, V], the mean
    cross-entropy over the example's own tokens (shifted for a causal LM, label -100 ignored:
    `dptrain.losses.per_sample_token_losses`). ConfigError for anything else."""
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    if logits.dim() == 2 and labels.dim() == 1:
        if logits.shape[1] == 1 and labels.is_floating_point():
            return F.mse_loss(logits[:, 0], labels.to(logits.dtype), reduction="none")
        return F.cross_entropy(logits, labels, reduction="none")
    if logits.dim() == 3 and labels.dim() == 2:
        return per_sample_token_losses(logits, labels, shift=_is_causal_lm(model))
    raise ConfigError(
        f"PrivateTrainer has no per-example loss for logits of shape {tuple(logits.shape)} and "
        f"labels of shape {tuple(labels.shape)}: DP-SGD needs one loss per example (a batch "
        "average over tokens mixes examples). Pass per_example_loss=fn(model, outputs, labels) "
        "-> Tensor[B] to PrivateTrainer.")


def _steps(count: int) -> str:
    """"1 step", "3 steps"."""
    return f"{count} step{'' if count == 1 else 's'}"


class _LedgerCallback(TrainerCallback):
    """Commits the next step to the ledger after each step, and stops the Trainer (before its
    next batch is drawn) when the budget forbids it."""

    def __init__(self, trainer: PrivateTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step < state.max_steps and not self.trainer._commit_next(state.max_steps):
            self.trainer.stopped_at_budget = True
            control.should_training_stop = True
        return control


class PrivateTrainer(Trainer):
    """A `transformers.Trainer` that trains with DP-SGD (see the module docstring).

    Args (besides the Trainer's own):
        privacy: the mechanism (`PrivacyArguments`).
        per_example_loss: fn(model, outputs, labels) -> Tensor[B], each example's own loss
            (default: `default_per_example_loss`).
        dataset_name: the training set's name in the ledger.

    After `train()`: `engine` (the PrivacyEngine), `epsilon` (spent at `delta`), `delta`, `ledger`.
    """

    def __init__(self, *args: Any, privacy: PrivacyArguments,
                 per_example_loss: PerExampleLoss | None = None,
                 dataset_name: str = "train_dataset", **kwargs: Any) -> None:
        if not isinstance(privacy, PrivacyArguments):
            raise ConfigError(f"privacy={privacy!r} must be a PrivacyArguments.")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ConfigError("PrivateTrainer needs args=TrainingArguments(output_dir=...): the "
                              "privacy ledger is written to its output_dir.")
        check_training_arguments(training_args, type(self))
        _check_trainer_arguments(kwargs)
        self.privacy = privacy
        self.logical_batch_size = (training_args.per_device_train_batch_size
                                   * training_args.gradient_accumulation_steps)
        self.physical_batch_size = training_args.per_device_train_batch_size
        # The Trainer steps once per item of the train loader, which is one logical batch.
        inner = copy.copy(training_args)
        inner.gradient_accumulation_steps = 1
        if "args" in kwargs:
            kwargs["args"] = inner
        else:
            args = (args[0], inner, *args[2:])
        self.per_example_loss_fn = per_example_loss or default_per_example_loss
        self.dataset_name = dataset_name
        self.engine: PrivacyEngine | None = None
        self.ledger: Any = None
        self.stopped_at_budget = False
        self._private_loader: Any = None
        self._spend: PrivacySpend | None = None
        self._position = Position()
        self._drawn_before: int | None = 0   # batches the sampler drew before the ledger started
        super().__init__(*args, **kwargs)
        self.add_callback(_LedgerCallback(self))

    # -- making the Trainer's objects private ----------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """The Poisson loader of logical batches (made private on first use)."""
        if self._private_loader is None:
            self._make_private()
        return self._private_loader

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The DPOptimizer around the Trainer's optimizer (made private on first use)."""
        if self._private_loader is None:
            self._make_private()
        return self.optimizer

    def _make_private(self) -> None:
        """make_private on the model, the Trainer's optimizer and a plain loader of logical
        batches over the Trainer's (column-pruned) dataset and collator; the ledger."""
        template = super().get_train_dataloader()   # never iterated: its dataset and collator
        plain = DataLoader(template.dataset, batch_size=self.logical_batch_size,
                           collate_fn=template.collate_fn,
                           num_workers=self.args.dataloader_num_workers,
                           pin_memory=self.args.dataloader_pin_memory)
        num_samples = len(template.dataset)
        # before a sigma is calibrated for q; self.args is the copy with accumulation 1
        check_logical_batch(self.physical_batch_size,
                            self.logical_batch_size // self.physical_batch_size, num_samples,
                            world=max(1, self.args.world_size))
        optimizer = super().create_optimizer()
        p = self.privacy
        self.delta = p.delta if p.delta is not None else default_delta(num_samples)
        engine = PrivacyEngine(accountant=p.accountant, secure_mode=p.secure_mode, seed=p.seed,
                               reproducible_mechanism=p.reproducible_mechanism)
        sigma = p.noise_multiplier if p.noise_multiplier is not None else get_noise_multiplier(
            target_epsilon=p.target_epsilon, target_delta=self.delta,
            sample_rate=self.logical_batch_size / num_samples,
            steps=self._planned_steps(num_samples), accountant=engine.accountant.name)
        module, dp_optimizer, loader = engine.make_private(
            module=self.model, optimizer=optimizer, data_loader=plain, noise_multiplier=sigma,
            max_grad_norm=p.max_grad_norm, clipping=p.clipping,
            grad_sample_mode=p.grad_sample_mode)
        self.engine, self.private_module, self.optimizer = engine, module, dp_optimizer
        self.dp_optimizer = dp_optimizer
        self._private_loader = loader
        self._start_ledger(num_samples)
        dp_optimizer.attach_step_hook(self._after_step)
        loader.add_hand_out_listener(self._before_batch)

    def _planned_steps(self, num_samples: int) -> int:
        """The noisy steps the Trainer will take: max_steps, else num_train_epochs epochs of
        steps_per_epoch(q) logical batches (rounded up, as the Trainer does)."""
        if self.args.max_steps > 0:
            return int(self.args.max_steps)
        per_epoch = steps_per_epoch(self.logical_batch_size / num_samples)
        return max(1, math.ceil(self.args.num_train_epochs * per_epoch))

    # -- the ledger --------------------------------------------------------------------------------
    def _ledger_config(self) -> dict[str, Any]:
        """What the ledger records of the run: the training and privacy arguments."""
        training = json_safe(self.args.to_dict())
        accumulation = self.logical_batch_size // self.physical_batch_size
        training["gradient_accumulation_steps"] = accumulation   # the caller's, not the copy's
        return {"trainer": f"transformers.{Trainer.__name__} (dptrain PrivateTrainer)",
                "training_args": training, "privacy": json_safe(asdict(self.privacy)),
                "model": type(self.model).__name__}

    def _start_ledger(self, num_samples: int) -> None:
        """A new ledger in output_dir (refused when one is there: that run's steps are spent)."""
        run_dir = ensure_writable_dir(self.args.output_dir, "TrainingArguments.output_dir")
        if (Path(run_dir) / LEDGER_FILENAME).exists():
            raise ConfigError(
                f"TrainingArguments.output_dir={str(run_dir)!r} already holds {LEDGER_FILENAME}, "
                "the record of an earlier private run: a new run there would overwrite what it "
                "spent. Choose a new output_dir, or move the earlier run's files away.")
        job = private_job(self.engine, self.private_module, self.optimizer, self._private_loader,
                          target_epsilon=self.privacy.target_epsilon, target_delta=self.delta,
                          dataset_name=self.dataset_name, config=self._ledger_config())
        settings = TrainSettings(epochs=max(1, math.ceil(self.args.num_train_epochs)),
                                 batch_size=self.logical_batch_size, run_dir=Path(run_dir))
        self.ledger = run_ledger(job, settings, Path(run_dir), "none")
        self.ledger.data["devices"] = [job.device.type]
        guard = BudgetGuard(self.privacy.target_epsilon, self.delta, self.ledger.data["accountant"])
        self._spend = PrivacySpend(job, self.ledger, guard, self._position)
        self._drawn_before = self._batches_drawn()
        self.ledger.write()

    def _commit_next(self, max_steps: int) -> bool:
        """Commit the next step (a block of steps, at most to max_steps) unless it is already
        committed; False when the budget forbids it."""
        return self._spend.ensure_committed(max(1, max_steps - self._position.step))

    def _before_batch(self) -> None:
        """Hand-out listener: a batch reaches the Trainer only once its step is committed."""
        if not self._commit_next(self.state.max_steps):
            raise BudgetExhaustedError(
                f"The next step would exceed target_epsilon={self.privacy.target_epsilon} at "
                f"delta={self.delta:g}; {self._position.step} steps were taken. Raise "
                "target_epsilon or lower max_steps / num_train_epochs.")

    def _after_step(self, optimizer: Any) -> None:
        """Step hook (after the accountant's): the position advances to the steps accounted."""
        self._position.step = self._spend.steps()

    @property
    def epsilon(self) -> float | None:
        """Epsilon spent so far at `delta` (None before training)."""
        return None if self._spend is None else self._spend.epsilon()

    def _batches_drawn(self) -> int | None:
        """Batches the private loader's Poisson sampler has drawn so far (None: no sampler)."""
        sampler = getattr(self._private_loader, "poisson_sampler", None)
        return None if sampler is None else int(sampler.batches_drawn)

    def _stopped_history(self) -> History:
        """The history a stopped run (Ctrl-C, an error) keeps charged: its committed steps up to
        the last one whose batch the Poisson sampler drew, and never fewer than the steps taken.

        A step's noise is drawn, and its update released, only after its batch was drawn, so the
        committed steps beyond the batches drawn never touched the data: they were committed
        ahead (in blocks, `_commit_next`) while the process was alive to release them, and this
        process takes no step after this point. Without a sampler to ask, every committed step
        stays charged. The guard's count follows (a later `train()` commits again from here).
        """
        committed = self.ledger.history
        drawn = self._batches_drawn()
        if drawn is None:
            return committed
        kept = min(history_steps(committed), max(self._spend.steps(), drawn - self._drawn_before))
        self._spend.committed = kept
        return truncate_history(committed, kept)

    def _finish(self, status: str, error: str | None = None) -> None:
        """The ledger's final write: every accountant's epsilon and `status`; the exact history
        of a finished run; for a stopped one, every step whose batch was drawn
        (`_stopped_history`), and a warning saying what the ledger charges."""
        if self.ledger is None:
            return
        refresh_layer_strategies(self.ledger, self.private_module)
        stopped = status in ("failed", "interrupted")
        committed = history_steps(self.ledger.history)
        history = self._stopped_history() if stopped else self._spend.spent()
        self.ledger.finish(status, history, self._spend.steps_completed(), error)
        if stopped:
            log.warning(self._stopped_line(status, committed))

    def _stopped_line(self, status: str, committed: int) -> str:
        """What a stopped run's ledger charges: its steps and epsilon, the steps charged beyond
        those trained and why (`charged_beyond_completed`), the committed steps released."""
        data = self.ledger.data
        charged = history_steps(self.ledger.history)
        line = (f"PrivateTrainer {status} after {_steps(self._position.step)}; its privacy "
                f"ledger {self.ledger.path} charges {_steps(charged)}, epsilon "
                f"{format_epsilon(self.ledger.epsilon)} at delta {data['delta']:g}")
        beyond = charged_beyond_completed(data)
        if beyond is not None:
            line += f": {beyond}"
        if committed > charged:
            line += (f". The other {_steps(committed - charged)} committed ahead had no batch "
                     "drawn (nothing was computed for them) and are no longer charged")
        return line + "."

    # -- the Trainer's entry points ----------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """Trainer.train, privately; the ledger is finished as "completed" (or
        "stopped_at_budget"), "interrupted" on Ctrl-C and "failed" on an error."""
        if resume_from_checkpoint:
            raise ConfigError(
                "PrivateTrainer.train(resume_from_checkpoint=...) is not supported: the Trainer's "
                "checkpoints hold no privacy accountant, so a resumed run would not charge the "
                "steps already taken. Train again from the start in a new output_dir.")
        try:
            output = super().train(None, *args, **kwargs)
        except KeyboardInterrupt:
            self._finish("interrupted")
            raise
        except BaseException as err:
            self._finish("failed", f"{type(err).__name__}: {err}")
            raise
        self._finish("stopped_at_budget" if self.stopped_at_budget else "completed")
        return output

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> Tensor:
        """One logical batch: forward and backward of each physical chunk, its per-example
        gradients clipped and summed; the raw gradient is discarded (the noisy one is written by
        the Trainer's `optimizer.step()`). Returns the mean loss of the batch's examples (not
        covered by epsilon, like every training loss)."""
        model.train()
        batch = dict(self._prepare_inputs(inputs))
        loss_sum = torch.zeros((), device=self.args.device)

        def forward_backward(chunk: dict[str, Any]) -> int:
            nonlocal loss_sum
            rows = batch_rows(chunk) or 0
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, chunk)
            self.accelerator.backward(loss)
            loss_sum += loss.detach().float() * rows
            return rows

        # the chunks' clipped sum; the Trainer's optimizer.step() releases the batch (its record)
        total = accumulate_chunks(self.dp_optimizer, batch, self.physical_batch_size,
                                  forward_backward)
        model.zero_grad(set_to_none=True)   # the unclipped gradient is never released
        return loss_sum / max(total, 1)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """In training, the mean over the chunk's examples of each example's own loss
        (`per_example_loss_fn`); in evaluation, the Trainer's own loss."""
        if not model.training:  # num_items_in_batch: a keyword of transformers >= 4.46 only
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **extra)
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:
            raise ConfigError("PrivateTrainer's training batches have no 'labels': each example's "
                              "loss needs its labels (a causal LM's labels are its input_ids: use "
                              "DataCollatorForLanguageModeling(tokenizer, mlm=False)).")
        outputs = self.private_module(**inputs)
        loss = self.per_example_loss_fn(self.model, outputs, labels).mean()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log record with the epsilon spent, without grad_norm (the norm of a
        gradient before noise is not private; a private run never forms it)."""
        logs = {k: v for k, v in logs.items() if k != "grad_norm"}
        if self._spend is not None:
            logs["epsilon"] = self._spend.epsilon()
        super().log(logs, *args, **kwargs)

