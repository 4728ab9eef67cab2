"""The training loop: `train(job, settings) -> RunResult`.

For each epoch the private loader is iterated, each logical batch is one explicit private step
(dptrain.privacy.step: physical chunks of `settings.max_physical_batch_size`, clipped sum, noise,
one optimizer step), each logical step is committed to the privacy ledger
BEFORE its data is read and the budget guard stops before the step that would exceed the target
epsilon (dptrain.train.budget), the model is evaluated every `eval_every` epochs and at the end
(dptrain.train.evaluation), metrics go to the metric loggers (dptrain.train.loggers:
`run_dir/metrics.jsonl` by default, the values epsilon does not cover to
`private_metrics.jsonl`) once per epoch (and every `every_n_steps` steps to a logger that asks)
and checkpoints are written every `checkpoint_every` epochs and at the end
(dptrain.train.checkpoint). A run folder is resumed with `settings.resume`
(dptrain.train.resume).

Files: `checkpoints/*.pt` are resume state (with a reproducible mechanism they hold the noise
and sampling generators' states); the model to release is `model.pt` (the final weights alone), written by
`checkpoint.save_weights`; with `keep_best` also `model_best.pt` (the weights of
`checkpoints/best.pt`), chosen on the validation examples without noise: not covered by
epsilon, not for release (the ledger's `model_selection`).

`Trainer` composes one collaborator per job and runs the epochs: `PrivacySpend` (what is spent
and committed), `Checkpointer`, `Evaluator`, `Resumer`, `Display`, around one shared `Position`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dptrain.accounting.history import history_steps
from dptrain.batches import call_model, inputs_and_targets, rows, to_device
from dptrain.data.batch_record import last_record
from dptrain.data.virtual import pads_passes, split_batch
from dptrain.errors import ConfigError, WriteError
from dptrain.grad_sample.workspace import retain_freed_memory
from dptrain.io import ensure_writable_dir
from dptrain.losses import step_losses
from dptrain.train import checkpoint as ckpt
from dptrain.train.budget import COMMIT_BLOCK_STEPS, BudgetGuard, PrivacySpend
from dptrain.train.checkpoint import BEST, LAST, Checkpointer
from dptrain.train.display import Display, shown_path, visible_notes
from dptrain.train.evaluation import Evaluator, Tally, autocast
from dptrain.train.job import (
    Evaluation,
    Position,
    RunInterrupted,
    RunPreempted,
    RunResult,
    TrainingJob,
    check_model_selection,
)
from dptrain.train.ledger import (
    history_steps,
    ledger_sampling,
    refresh_layer_strategies,
    run_ledger,
)
from dptrain.train.loggers import (
    JsonlLogger,
    MetricLogger,
    MetricLoggers,
    learning_rates,
    with_run_record,
)
from dptrain.privacy.step import private_step
from dptrain.randomness import seed_everything
from dptrain.formatting import format_epsilon
from dptrain.train.lr_schedule import LR_SCHEDULE_NOTE, make_lr_scheduler
from dptrain.train.preemption import Preemption
from dptrain.train.resume import Resumer, resume_on_every_rank
from dptrain.train.run_lock import hold_run_folder
from dptrain.train.settings import TrainSettings

# The system errors of storage that cannot take more bytes: disk full, quota reached.
FULL_STORAGE = (errno.ENOSPC, errno.EDQUOT)


class Trainer:
    """One call of `train`: the epochs and steps, the metric records, and the run's collaborators.
    """

    def __init__(self, job: TrainingJob, settings: TrainSettings, run_dir: Path,
                 loggers: Sequence[MetricLogger] | None = None) -> None:
        self.job, self.settings, self.run_dir = job, settings, run_dir
        self.pos = Position()
        private = job.engine is not None
        self._attach_lr_scheduler()
        self.ledger = run_ledger(job, settings, run_dir, f"{ckpt.CHECKPOINT_DIRNAME}/{BEST}",
                                 ckpt.BEST_MODEL_FILENAME)
        guard = BudgetGuard(job.privacy.target_epsilon if private else None,
                            self.ledger.data["delta"], self.ledger.data["accountant"],
                            ledger_sampling(self.ledger.data))
        self.spend = PrivacySpend(job, self.ledger, guard, self.pos)
        self.checkpointer = Checkpointer(job, run_dir, self.pos, self.spend, self.ledger,
                                         settings.keep_checkpoints)
        self.display = Display(settings.progress)
        self.evaluator = Evaluator(job, settings, self.pos, self.display)
        self.loggers = MetricLoggers(with_run_record(run_dir, loggers or []))
        self.resumer = Resumer(job, settings, run_dir, self.pos, self.spend, self.checkpointer,
                               self.ledger, self.loggers)
        self.preemption = Preemption()
        self._epoch_started = time.monotonic()
        self.ledger.data["start_fingerprint"] = self.checkpointer.fingerprint()
        self.ledger.data["lr_schedule"] = self._lr_schedule_record()
        self.ledger.data["devices"] = [job.device.type]
        self.ledger.data["dataset"]["fingerprints"] = [self.checkpointer.data_fingerprint]
        if self.checkpointer.user_fingerprint is not None:   # a user-level run's users
            self.ledger.data["dataset"]["user_fingerprints"] = [self.checkpointer.user_fingerprint]

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Train until every epoch (or max_steps, or the budget) is done; the result.

        Ctrl-C raises RunInterrupted (a KeyboardInterrupt) carrying the result so far, after the
        ledger is marked "interrupted"; SIGTERM or SIGUSR1 (`self.preemption`, handled by
        `train`) stops after the step in progress and raises RunPreempted after writing
        `checkpoints/last.pt` and marking the ledger "preempted"; any other error marks it
        "failed" and propagates.
        """
        self.ledger.write()
        self.loggers.log_config(self.job.config)
        status = "completed"
        try:
            while not self.settings.finished(self.pos):
                self._train_epoch()
                if self.pos.stopped_at_budget:
                    status = "stopped_at_budget"
                    break
                if self.preemption.signum is not None:
                    self._preempt()
            self._final_eval_and_checkpoint()
            self.checkpointer.save_model()
        except RunPreempted:
            raise
        except KeyboardInterrupt:
            if self.preemption.signum is not None:   # a second preempting signal: stop now
                self._end("preempted")
                raise RunPreempted(self._result("preempted"), self.preemption.signum,
                                   self.preemption.name) from None
            self._end("interrupted")
            raise RunInterrupted(self._result("interrupted")) from None
        except BaseException as err:
            self._end("failed", f"{type(err).__name__}: {err}")
            if isinstance(err, OSError) and (written := self._write_failure(err)):
                raise written from err
            raise
        refresh_layer_strategies(self.ledger, self.job.model)
        self.ledger.finish(status, self.spend.spent(), self.spend.steps_completed())
        result = self._result(status)
        self.display.summary(result, self.ledger)
        return result

    def _attach_lr_scheduler(self) -> None:
        """`settings.lr_schedule` as a scheduler on the job's optimizer (unless the job brings
        its own, or the rate is constant), over `epochs` times the steps of an epoch."""
        schedule = self.settings.lr_schedule
        if self.job.lr_scheduler is not None or schedule is None or schedule.kind == "constant":
            return
        per_epoch = self._steps_per_epoch()
        if per_epoch is None:
            raise ConfigError(
                f"lr_schedule={schedule.kind} needs the number of steps of the run, but the "
                f"training loader has no length: use lr_schedule=constant, or pass a torch LR "
                f"scheduler as TrainingJob.lr_scheduler.")
        self.job.lr_scheduler = make_lr_scheduler(self.job.optimizer, schedule,
                                                  self.settings.epochs * per_epoch)

    def _lr_schedule_record(self) -> dict[str, Any]:
        """The ledger's `lr_schedule`: what sets the rate of each step, and its privacy cost
        (none: post-processing)."""
        scheduler = self.job.lr_scheduler
        if scheduler is None:
            return self.settings.lr_schedule.record(self.settings.epochs
                                                    * (self._steps_per_epoch() or 0))
        return getattr(scheduler, "record", None) or {"kind": type(scheduler).__name__,
                                                      "privacy": LR_SCHEDULE_NOTE}

    def _steps_per_epoch(self) -> int | None:
        try:
            return len(self.job.train_loader)
        except TypeError:
            return None

    def _train_epoch(self) -> None:
        job, pos = self.job, self.pos
        per_epoch = self._steps_per_epoch()
        left = math.inf if per_epoch is None else per_epoch - pos.steps_in_epoch
        tally = Tally()
        job.model.train()
        self._epoch_started = time.monotonic()
        if pos.steps_in_epoch == 0:
            self.checkpointer.mark_epoch_start()
        with self.display.epoch(pos.epoch, self.settings.epochs, per_epoch):
            finished = self._run_steps(self._epoch_iterator(), left, tally)
        if finished or (per_epoch is not None and pos.steps_in_epoch >= per_epoch):
            pos.epoch += 1
            pos.steps_in_epoch = 0
            self._end_of_epoch(tally)
        else:
            record = self._log(tally, evaluated=False)
            of = "" if per_epoch is None else f" of {per_epoch}"
            self.display.epoch_line(
                f"epoch {pos.epoch + 1}/{self.settings.epochs} (stopped after "
                f"{pos.steps_in_epoch}{of} steps)", record, time.monotonic() - self._epoch_started)

    def _run_steps(self, batches: Iterator[Any], left: float, tally: Tally) -> bool:
        """Logical steps until the epoch ends (True), or max_steps / budget stops it (False).

        Each logical batch is one step (`_step`): committed to the ledger before it runs."""
        pos, spend = self.pos, self.spend
        done = 0
        while done < left:
            if self.settings.stop_requested(pos) or self.preemption.requested():
                return False
            steps_left = min(left - done, spend.steps_left(self.settings.max_steps))
            if not spend.ensure_committed(steps_left):
                pos.stopped_at_budget = True
                return False
            start = (tally.loss_sum, tally.samples)
            batch = next(batches, None)
            if batch is None:
                return True
            self._step(batch, tally)
            pos.step += 1
            if self.job.lr_scheduler is not None:
                self.job.lr_scheduler.step()   # the rate of the next logical step
            pos.steps_in_epoch += 1
            done += 1
            self.display.advance(tally, self.spend.epsilon)
            self._log_step(tally, start)
        return True

    def _step(self, batch: Any, tally: Tally) -> None:
        """One logical step: the private step (dptrain.privacy.step: chunks, clipped sum, noise,
        one optimizer step), or plain gradient accumulation over chunks without privacy. A
        batch is an `(x, y)` pair or a mapping of tensors (dptrain.batches); its chunks are cut
        along dim 0 alike."""
        job = self.job
        chunk = self.settings.max_physical_batch_size
        if self.spend.private:
            def forward_backward(part: Any) -> int:
                part = to_device(part, job.device)
                self._forward_backward(part, tally, weight=1.0)
                return rows(part) or 0

            # the record of the batch just handed out: its q is the step's charge
            private_step(job.optimizer, batch, chunk, forward_backward,
                         last_record(job.train_loader))
            tally.nonfinite = tally.nonfinite + job.optimizer.excluded_examples
            return
        job.optimizer.zero_grad(set_to_none=True)
        batch = to_device(batch, job.device)
        total = rows(batch) or 0
        # non-private gradient accumulation over chunks of the logical batch
        for part in (split_batch(batch, chunk) if chunk else [batch]):
            size = rows(part) or 0
            self._forward_backward(part, tally, weight=size / total if total else 1.0)
        job.optimizer.step()
        self.spend.nonprivate_steps += 1

    def _forward_backward(self, batch: Any, tally: Tally, weight: float) -> None:
        """Forward and backward of one chunk: the mean of the job's per-example losses
        (`job.step_loss`), times `weight` (a chunk's share of a non-private logical batch)."""
        size = rows(batch) or 0
        if size == 0:  # empty Poisson batch: the optimizer step adds noise only
            if pads_passes(self.job.optimizer):
                self._empty_pass(batch)  # a sharded model: the other ranks' passes need this one's
            return
        with autocast(self.job):
            losses = step_losses(self.job.step_loss, self.job.model, batch)
            loss = losses.losses.mean()
        (loss * weight if weight != 1.0 else loss).backward()
        tally.add(losses, size)

    def _empty_pass(self, batch: Any) -> None:
        """Forward and backward of an empty batch (0 rows, zero gradients): a fully sharded
        model gathers its parameters in every pass, collectives every rank must join (the
        private module runs it on a placeholder row it discards, dptrain.distributed.fsdp)."""
        inputs, _ = inputs_and_targets(batch)
        with autocast(self.job):
            out = call_model(self.job.model, inputs)
        (out.sum() * 0.0).backward()

    def _epoch_iterator(self) -> Iterator[Any]:
        """A new iterator over the epoch's logical batches.

        Its creation (which draws the loader's base seed) runs under a forked RNG, so it never
        shifts the global torch RNG (dropout...). After a mid-epoch resume the loader's generators
        are set back to their epoch-start states and the `steps_in_epoch` batches already trained
        on are drawn again and discarded; then every random state is restored as it was at the
        checkpoint, so the rest of the epoch sees exactly the batches of an uninterrupted run.
        A shuffled loader's sampler was restored at its place in the epoch's shuffle (its batches
        are not drawn again: a batch handed out and not stepped on is refused); the loop takes
        the epoch's remaining steps from a new iterator.
        """
        forward = self.resumer.fast_forward
        self.resumer.fast_forward = None
        plan = self.job.privacy.plan
        if forward is not None and plan is not None and plan.selection.epoch_bound:
            forward = None
        if forward is not None:
            self.checkpointer.restore_generators(forward["epoch_start_generators"], "resume")
        with torch.random.fork_rng(devices=[]):
            iterator = iter(self.job.train_loader)
            for _ in range(forward["steps_in_epoch"] if forward is not None else 0):
                next(iterator)
        if forward is not None:
            self.checkpointer.restore_random_state(forward, "resume")
        return iterator

    # -- epoch ends ----------------------------------------------------------------------------
    def _end_of_epoch(self, tally: Tally) -> None:
        """Evaluate, log and checkpoint as `eval_every` / `checkpoint_every` ask; with keep_best,
        every evaluation that beats the best validation accuracy so far is saved as best.pt."""
        every = self.settings.eval_every
        evaluate_now = every > 0 and self.pos.epoch % every == 0
        if evaluate_now:
            self.evaluator.evaluate()
        record = self._log(tally, evaluated=evaluate_now)
        self.display.epoch_line(f"epoch {self.pos.epoch}/{self.settings.epochs}", record,
                                time.monotonic() - self._epoch_started)
        every = self.settings.checkpoint_every
        due = every > 0 and self.pos.epoch % every == 0
        names = ([f"epoch_{self.pos.epoch}.pt", LAST] if due else []) + self._best()
        if names:
            self.checkpointer.save(names)

    def _best(self) -> list[str]:
        return [BEST] if self.evaluator.is_new_best() else []

    def _log(self, tally: Tally, evaluated: bool) -> dict[str, Any]:
        """The epoch's metrics record, sent to the loggers (which split off its private values:
        training loss and accuracy, validation metrics, time, and in a private run the number of
        examples left out of the epoch's clipped sums for a gradient that is not finite)."""
        record: dict[str, Any] = {"epoch": self.pos.epoch,
                                  "train_loss": tally.loss, "train_accuracy": tally.accuracy,
                                  "epsilon": self.spend.epsilon(), **self._mechanism_metrics(),
                                  "time": time.time()}
        if self.spend.private:  # a statistic of the training data: private (split_private)
            record["nonfinite_examples"] = int(tally.nonfinite)
        if evaluated and self.pos.last_eval is not None:
            record.update(self.evaluator.metrics())
        self.loggers.log(self.pos.step, record)
        return record

    def _mechanism_metrics(self) -> dict[str, float]:
        """sigma and q of the last step taken, the clipping bound C (private runs) and the
        learning rate(s): public values, logged next to epsilon."""
        out: dict[str, float] = {}
        history = self.spend.history()
        if history:
            out["noise_multiplier"], out["sample_rate"] = history[-1][0], history[-1][1]
        if self.spend.private:
            out["max_grad_norm"] = float(self.job.optimizer.max_grad_norm)
        out.update(learning_rates(self.job.optimizer.param_groups))
        return out

    def _log_step(self, tally: Tally, start: tuple[Any, int]) -> None:
        """The mean loss of the step just taken (tally minus its `start` (loss sum, samples)) to
        the loggers that ask for this step; only then is it read (a wait for the accelerator)."""
        if not self.loggers.step_due(self.pos.step):
            return
        samples = tally.samples - start[1]
        loss = float(tally.loss_sum - start[0]) / samples if samples else None
        self.loggers.log_step(self.pos.step, {"step_loss": loss})

    def _final_eval_and_checkpoint(self) -> None:
        if not self.evaluator.current():
            started = time.monotonic()
            self.evaluator.evaluate()
            record = {"epoch": self.pos.epoch, "final": True, **self.evaluator.metrics(),
                      "epsilon": self.spend.epsilon(), **self._mechanism_metrics(),
                      "time": time.time()}
            self.loggers.log(self.pos.step, record)
            self.display.epoch_line("final evaluation", record, time.monotonic() - started)
        if self.checkpointer.last_saved_step == self.pos.step:
            return  # the end-of-epoch checkpoint already saved this very state
        self.checkpointer.save([LAST, *self._best()])

    # -- endings -------------------------------------------------------------------------------
    def _preempt(self) -> None:
        """After the step in progress when a preempting signal arrived: checkpoint the state
        (`last.pt`, no evaluation: a preempted job has seconds), mark the ledger "preempted" and
        raise RunPreempted."""
        if self.checkpointer.last_saved_step != self.pos.step:
            self.checkpointer.save([LAST])
        refresh_layer_strategies(self.ledger, self.job.model)
        self.ledger.finish("preempted", self.spend.spent(), self.spend.steps_completed())
        signum = int(self.preemption.signum)
        raise RunPreempted(self._result("preempted"), signum, self.preemption.name)

    def _end(self, status: str, error: str | None = None) -> None:
        """Mark the ledger "interrupted", "preempted" or "failed", keeping every committed step
        (never under-report)."""
        with contextlib.suppress(Exception):  # the original error matters more than the write
            self.ledger.finish(status, self.ledger.history, self.spend.steps_completed(),
                               error=error)

    def _write_failure(self, err: OSError) -> WriteError | None:
        """A run file the system refused to write (WriteError from dptrain.io, or a full disk or
        quota met by another writer) as one paragraph: the file, the reason and what the ledger
        (marked "failed" by `_end`) charges; None for any other OSError."""
        if not isinstance(err, WriteError) and err.errno not in FULL_STORAGE:
            return None
        what = str(err) if isinstance(err, WriteError) else (
            f"Could not write {err.filename or 'a run file'}: {err.strerror or err}.")
        ledger = self.ledger
        charged = "records a run without privacy"
        if ledger.private:
            charged = (f"charges {history_steps(ledger.history)} steps, epsilon "
                       f"{format_epsilon(ledger.epsilon or 0.0)} at delta {ledger.data['delta']:g}")
        failure = WriteError(
            f"{what} The run stopped after {self.spend.steps_completed()} steps; its privacy "
            f"ledger {shown_path(ledger.path)} {charged}. Every file written before was "
            "written whole: the run can be resumed once the disk has room.")
        failure.errno = err.errno
        return failure

    def _result(self, status: str) -> RunResult:
        last = self.pos.last_eval or Evaluation(self.pos.step, None, None)
        result = RunResult(status=status, steps=self.pos.step, epochs_completed=self.pos.epoch,
                           epsilon=self.ledger.epsilon, delta=self.ledger.data["delta"],
                           test_accuracy=last.test_accuracy, test_loss=last.test_loss,
                           run_dir=self.run_dir, val_accuracy=last.val_accuracy,
                           val_loss=last.val_loss, test_perplexity=last.test_perplexity,
                           val_perplexity=last.val_perplexity,
                           steps_charged=(history_steps(self.ledger.history)
                                          if self.spend.private else None))
        return result


def _check_job(job: TrainingJob, settings: TrainSettings) -> None:
    """ConfigError for a job the settings cannot train (the settings' own values were checked
    when TrainSettings was made)."""
    if job.precision not in ("fp32", "bf16"):
        raise ConfigError(f"precision={job.precision!r} cannot be used: set it to `fp32` or `bf16`.")
    check_model_selection(settings.keep_best, job.validation_loader is not None)


def train(job: TrainingJob, settings: TrainSettings,
          loggers: Sequence[MetricLogger] | None = None) -> RunResult:
    """Run a training job: loop, evaluation, metrics, ledger, checkpoints, resume, budget guard.

    `loggers` receive the metrics (dptrain.train.loggers; default: metrics.jsonl, and the
    private ones in private_metrics.jsonl) and are closed when the run ends, however it ends.

    The run folder is locked for the whole call (dptrain.train.run_lock): RunFolderBusyError
    (a ConfigError) when another process holds it, unless `settings.wait_for_lock`.
    Raises ConfigError before training when the run folder cannot be written, a setting is
    invalid, or the resume checkpoint is missing, corrupt or from another config (under
    hardware=ddp: on every rank, also when the ranks resumed to different states); raises
    BudgetExhaustedError when resuming a run whose budget is already spent. Ctrl-C raises
    RunInterrupted (a KeyboardInterrupt) with the result so far; the ledger says "interrupted".
    SIGTERM or SIGUSR1 (a scheduler's preemption; main thread only) stops the run after the step
    in progress, writes `checkpoints/last.pt` and raises RunPreempted (a RunInterrupted); the
    ledger says "preempted" (dptrain.train.preemption).
    Without rich bars (`settings.progress` off, or no terminal) the run's progress lines go to
    the `dptrain.train` logger (shown on stdout when logging is not configured).
    """
    _check_job(job, settings)
    run_dir = ensure_writable_dir(settings.run_dir)
    with visible_notes(), hold_run_folder(run_dir, settings.wait_for_lock):
        seed_everything(settings.seed)
        retain_freed_memory()
        trainer = Trainer(job, settings, run_dir, loggers)
        with trainer.loggers, trainer.preemption.installed():
            resume_on_every_rank(trainer.resumer)
            trainer.resumer.record()
            return trainer.run()
