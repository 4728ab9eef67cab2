"""Resume: continue a run from its folder, or refuse to touch another run's record.

`settings.resume` (a checkpoint path, or "auto": the newest checkpoint of the run folder)
restores every state a checkpoint holds (dptrain.train.checkpoint; generators seeded from OS
entropy are not saved: the resumed run draws fresh noise and fresh batches). The steps an earlier process
had committed beyond the resume point stay in the ledger: charged once, as the steps the resumed
run retakes, when the replay is exact (a reproducible mechanism on the CPU, over the same training
data), and charged in addition to them otherwise (dptrain.train.replay). A run folder holding
another run's ledger (another config, or no resume asked) is refused, and so is resuming a run
whose budget is spent; nothing is changed then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dptrain.accounting.history import (History, history_from_json, history_steps, merge_history,
                                      steps_after)
from dptrain.distributed.consistency import check_same_on_every_rank
from dptrain.distributed.fsdp import load_model_state_dict, load_optimizer_state_dict
from dptrain.distributed.runtime import is_main_process
from dptrain.privacy.plan import PrivacyPlan
from dptrain.errors import BudgetExhaustedError, ConfigError, PrivacyError
from dptrain.formatting import format_epsilon
from dptrain.train import checkpoint as ckpt
from dptrain.train.budget import PrivacySpend
from dptrain.train.checkpoint import Checkpointer
from dptrain.train.display import note, shown_path
from dptrain.train.job import Position, TrainingJob, unwrap
from dptrain.train.loggers import METRICS_FILENAME, MetricLoggers
from dptrain.train.lr_schedule import restore_lr_scheduler
from dptrain.train.ledger import (
    LEDGER_FILENAME,
    PrivacyLedger,
    carry_partition,
    carry_randomness,
    describe_differences,
    load_ledger,
    same_config,
)
from dptrain.data.fingerprint import UNKNOWN
from dptrain.train.ledger_check import newest_checkpoint_step
from dptrain.train.replay import (data_difference, replay_is_exact, still_charged,
                                  user_difference)
from dptrain.train.settings import TrainSettings, setting_name


class Resumer:
    """Brings a new run to where the run folder's earlier process left it (`resume`, read-only),
    then records the resume (`record`, rank 0 writes)."""

    def __init__(self, job: TrainingJob, settings: TrainSettings, run_dir: Path,
                 position: Position, spend: PrivacySpend, checkpointer: Checkpointer,
                 ledger: PrivacyLedger, loggers: MetricLoggers) -> None:
        self.job, self.settings, self.run_dir, self.pos = job, settings, run_dir, position
        self.spend, self.checkpointer, self.ledger, self.loggers = spend, checkpointer, ledger, loggers
        self.fast_forward: dict[str, Any] | None = None   # a mid-epoch checkpoint's state
        self._pending: tuple[str | None, int, int] | None = None  # for `record`
        self._found_nothing = False   # train.resume=auto in a folder without a run: said in `record`
        self._data_difference: str | None = None   # why the data bar an exact replay (the note)
        # checkpoint files an earlier process wrote and was killed before recording
        self._found: list[ckpt.FoundCheckpoint] = []

    def resume(self) -> None:
        """Restore everything from settings.resume, or refuse to overwrite another run's ledger.

        Reads only: nothing is written here (`record` writes), so under hardware=ddp every rank
        reads the run folder before rank 0 changes it.
        """
        path = ckpt.resolve_resume(self.settings.resume, self.run_dir)
        previous = self._previous_ledger()
        if previous is not None:
            self._refuse_other_run(previous, path)
            self._refuse_other_plan(previous)
        elif self.settings.resume:
            self._refuse_without_ledger()
        state = None
        if path is not None:
            state = ckpt.load_checkpoint(path)
            ckpt.check_same_config(state, self.job.config, path)
        if previous is not None:
            self._found = ckpt.unrecorded_checkpoints(
                self.run_dir, PrivacyLedger(self.run_dir, previous).existing_checkpoints(),
                None if state is None else (path, state))
        if path is not None:
            self._refuse_secure_rewind(state, previous, path)
            self._refuse_new_shuffle_mid_epoch(state, path)
            self._restore(state, path)
        if previous is None and state is None:
            self._found_nothing = self.settings.resume == "auto"
            return  # a new run
        self.spend.charged = merge_history(state.get("charged", [])) if state is not None else []
        discarded, charged = self._carry_over(previous, state) if previous is not None else (0, 0)
        self._refuse_if_exhausted(path)
        self._pending = (None if path is None else str(path), discarded, charged)

    def record(self) -> None:
        """After a resume: note it in the ledger, commit the restored history, cut the metric
        logs back to the resume point (rank 0 writes) and say where the run resumed and what it
        has spent. For a new run, only says when `train.resume=auto` found nothing to resume."""
        if self._pending is None:
            if self._found_nothing and is_main_process():
                note(f"{setting_name('train.resume', 'auto')}: no checkpoint and no privacy ledger in "
                     f"{shown_path(self.run_dir)}, so the run starts from step 0.")
            return
        path, discarded, charged = self._pending
        self._pending = None
        self.ledger.record_resume(path, self.pos.step, discarded, charged)
        self.spend.commit_done()
        self.loggers.resume_at(self.pos.step)
        if is_main_process():
            note(self._resumed_line(path, charged))

    def _resumed_line(self, path: str | None, charged: int) -> str:
        """"resumed from <checkpoint> at step N, epsilon so far E" (and the steps kept charged)."""
        where = (f"resumed from {shown_path(path)}" if path is not None else
                 "restarted from step 0 (the run folder holds no checkpoint)")
        line = f"{where} at step {self.pos.step}"
        if self.spend.private:
            line += f", epsilon so far {format_epsilon(self.ledger.epsilon)} (delta {self.ledger.data['delta']:g})"
        if charged and self._data_difference:
            line += (f"; {charged} steps an earlier process took beyond it stay charged: "
                     f"{self._data_difference}")
        elif charged:
            line += (f"; {charged} steps an earlier process took beyond it stay charged (their "
                     "replay is not the same computation)")
        return line + "."

    def state(self) -> dict[str, Any]:
        """What every rank of a hardware=ddp run must have resumed to: step and spent history."""
        return {"step": self.pos.step, "history": [list(run) for run in self.spend.spent()]}

    def _reproducible_mechanism(self) -> bool:
        """Whether replayed steps draw the noise and the batches they drew the first time: only
        with a reproducible mechanism (seeded generators restored from the checkpoint); noise and
        sampling seeded from OS entropy or drawn in secure mode are fresh on every replay."""
        return self.spend.private and self.job.engine.mechanism_replays()

    # -- refusals ------------------------------------------------------------------------------
    def _previous_ledger(self) -> dict[str, Any] | None:
        if not (self.run_dir / LEDGER_FILENAME).exists():
            return None
        # ConfigError when corrupt, or when the run's records show more than its history
        return load_ledger(self.run_dir / LEDGER_FILENAME, check_records=True)

    def _refuse_other_run(self, previous: dict[str, Any], path: Path | None) -> None:
        """ConfigError when the run folder's ledger belongs to another run: no resume asked, or
        a ledger written with another config (its history could not be replayed)."""
        if path is None and self.settings.resume != "auto":
            raise ConfigError(
                f"The run folder {str(self.run_dir)!r} ({setting_name('hydra.run.dir')}) already "
                "holds a privacy ledger from another run; use a new folder, or "
                f"`{setting_name('train.resume', 'auto')}` to continue that run. Nothing was "
                "changed.")
        if not same_config(previous["config_hash"], previous["config"], self.job.config):
            raise ConfigError(
                f"The run folder {str(self.run_dir)!r} holds the privacy ledger of a run with a "
                f"different config; differing keys: "
                f"{describe_differences(previous['config'], self.job.config)}. Continue it with "
                f"the same config, or use a new folder ({setting_name('hydra.run.dir')}). "
                "Nothing was changed.")

    def _refuse_other_plan(self, previous: dict[str, Any]) -> None:
        """ConfigError when the ledger's plan (schema version 2) is not this job's."""
        plan = self.job.privacy.plan
        if plan is None or previous.get("plan") is None:
            return  # non-private, or a version-1 ledger (its config was compared)
        differences = PrivacyPlan.from_dict(previous["plan"]).differences(plan)
        if differences:
            raise ConfigError(
                f"The run folder {str(self.run_dir)!r} holds the privacy ledger of a run with "
                f"another privacy plan ({'; '.join(differences[:5])}). Continue it with the same "
                "privacy settings, or use a new folder (hydra.run.dir). Nothing was changed.")

    def _refuse_new_shuffle_mid_epoch(self, state: dict[str, Any], path: Path) -> None:
        """ConfigError when a shuffled run would resume inside an epoch whose shuffle the
        checkpoint does not hold (noise and sampling from OS entropy or secure mode never save
        it): the rest of the epoch would come from a new shuffle, and an example already trained
        on in this epoch could be drawn again, charged once."""
        plan = self.job.privacy.plan
        if (plan is None or not plan.selection.epoch_bound or not int(state.get("steps_in_epoch", 0))
                or self._reproducible_mechanism()):
            return
        raise ConfigError(
            f"Cannot resume from {str(path)!r} ({setting_name('train.resume')}): it was written "
            f"{state['steps_in_epoch']} steps into an epoch of a run whose examples each take "
            f"part once an epoch (privacy.sampling={plan.selection.kind}), and the epoch's shuffle "
            "or allocation is saved only with a "
            "reproducible mechanism: the rest of the epoch would come from a new shuffle that "
            "could repeat an example already trained on, charged once. Resume from a checkpoint "
            "written at an epoch's end (train.resume=run/checkpoints/epoch_N.pt), or start runs "
            "that must resume mid-epoch with privacy.reproducible_mechanism=true. Nothing was "
            "changed.")

    def _refuse_without_ledger(self) -> None:
        """ConfigError when a resume is asked in a folder that holds an earlier run's files
        (checkpoints, metrics) but no ledger: what that run spent is unknown, and a new ledger
        would not count it."""
        checkpoints = sorted((self.run_dir / ckpt.CHECKPOINT_DIRNAME).glob("*.pt"))
        found = [f"{ckpt.CHECKPOINT_DIRNAME}/{p.name}" for p in checkpoints[:3]]
        if (self.run_dir / METRICS_FILENAME).exists():
            found.append(METRICS_FILENAME)
        if not found:
            return
        raise ConfigError(
            f"Cannot resume in the run folder {str(self.run_dir)!r} "
            f"({setting_name('train.resume')}): it holds an "
            f"earlier run's files ({', '.join(found)}) but no privacy ledger ({LEDGER_FILENAME}), "
            "so the steps that run took, and the privacy they spent, are unknown; a resume would "
            "start a new ledger that leaves them out. Restore the ledger from a backup to "
            f"continue the run, or start a new run in a new folder "
            f"({setting_name('hydra.run.dir')}). Nothing was changed.")

    def _refuse_secure_rewind(self, state: dict[str, Any], previous: dict[str, Any] | None,
                              path: Path) -> None:
        """In secure mode a replay draws fresh noise: resuming behind a checkpoint already
        written would release a second, different version of the same steps, which the ledger
        would not count. Refused (PrivacyError)."""
        if not (self.spend.private and self.job.privacy.secure_mode and previous):
            return
        written = max([newest_checkpoint_step(previous), *(f.step for f in self._found)])
        if written > int(state["step"]):
            raise PrivacyError(
                f"Cannot resume from {str(path)!r} ({setting_name('train.resume')}) at step "
                f"{state['step']}: with {setting_name('privacy.secure_mode', True)} the run already wrote a checkpoint at step {written}, "
                "and replaying those steps with fresh noise would spend privacy the ledger cannot "
                "count. Resume from the newest checkpoint "
                f"(`{setting_name('train.resume', 'auto')}`).")

    def _refuse_if_exhausted(self, path: Path | None) -> None:
        """BudgetExhaustedError when the run has steps left but the next one would exceed the
        target epsilon (a finished run may be "resumed": it takes no step)."""
        guard = self.spend.guard
        if not self.spend.private or guard.target is None or self.settings.finished(self.pos):
            return
        if self.spend.admissible(self.spend.upcoming(1)) == 0:
            raise BudgetExhaustedError(
                f"Cannot resume from {str(path)!r} ({setting_name('train.resume')}): its "
                f"{self.pos.step} steps already reach the target epsilon {guard.target} "
                f"({setting_name('privacy.target_epsilon')}); one more step would exceed it. Nothing was changed.")

    # -- restoring -----------------------------------------------------------------------------
    def _restore(self, state: dict[str, Any], path: Path) -> None:
        job, pos = self.job, self.pos
        model = unwrap(job.model)  # whole states: any number of ranks (fully sharded or not)
        load_model_state_dict(model, state["model"])
        load_optimizer_state_dict(model, getattr(job.optimizer, "original_optimizer",
                                                 job.optimizer), state["optimizer"])
        if job.lr_scheduler is not None:
            restore_lr_scheduler(job.lr_scheduler, state.get("lr_scheduler"), int(state["step"]))
        if not self.spend.private:
            self.spend.nonprivate_steps = int(state["step"])
        self.checkpointer.restore_random_state(state, path)
        pos.step, pos.epoch = int(state["step"]), int(state["epoch"])
        pos.steps_in_epoch = int(state.get("steps_in_epoch", 0))
        pos.best_val_accuracy = state.get("best_val_accuracy")
        if self.spend.private and self.spend.steps() != pos.step:
            raise ConfigError(f"Checkpoint {str(path)!r} is inconsistent: step {pos.step} "
                              f"but its accountant holds {self.spend.steps()} steps.")
        if pos.steps_in_epoch > 0:
            self.fast_forward = state
            self.checkpointer.epoch_start_generators = state["epoch_start_generators"]

    def _carry_over(self, previous: dict[str, Any], state: dict[str, Any] | None
                    ) -> tuple[int, int]:
        """Keep the previous ledger's record (resumes, every checkpoint written, and the files on
        disk a killed process wrote but did not record) and every step it committed beyond the
        resume point: as steps this run retakes (`spend.replayed`) when
        the replay is exact, else charged in addition (`spend.charged`).

        Returns (steps retaken by the exact replay, steps charged in addition).
        """
        data, spend = self.ledger.data, self.spend
        same_start = previous.get("start_fingerprint") == data["start_fingerprint"]
        data["resumes"] = previous["resumes"]
        self.ledger.carry_checkpoints(previous)
        for found in self._found:   # recorded after the earlier processes' files: written last
            self.ledger.add_found_checkpoint(found.path, found.step, found.epoch, found.spent)
        data["start_fingerprint"] = previous.get("start_fingerprint")
        data["devices"] = sorted(set(previous.get("devices", ["unknown"])) | set(data["devices"]))
        recorded = self._recorded_data(previous, state)
        data["dataset"]["fingerprints"] = list(dict.fromkeys(
            [*recorded, self.checkpointer.data_fingerprint]))
        users = self.checkpointer.user_fingerprint   # None at example level
        recorded_users = self._recorded_users(previous, state)
        if users is not None:
            data["dataset"]["user_fingerprints"] = list(dict.fromkeys([*recorded_users, users]))
        carry_randomness(previous.get("mechanism"), data["mechanism"])
        carry_partition(previous.get("mechanism"), data["mechanism"])
        if not spend.private:
            return max(0, previous["steps_completed"] - self.pos.step), 0
        self._data_difference = (data_difference(recorded, self.checkpointer.data_fingerprint)
                                 or user_difference(recorded_users, users))
        exact = replay_is_exact(data["devices"], self._reproducible_mechanism(),
                                from_checkpoint=state is not None, same_start=same_start,
                                same_data=self._data_difference is None)
        history = history_from_json(previous["history"])
        resumed_steps = history_steps(spend.charged) + self.pos.step
        lost = still_charged(history, resumed_steps, exact)
        self._refuse_shifted_steps(lost)
        spend.charged = merge_history(lost + spend.charged)
        spend.replayed = steps_after(history, resumed_steps) if exact else []
        spend.resumed_at = self.pos.step
        return history_steps(spend.replayed), history_steps(lost)

    def _refuse_shifted_steps(self, lost: History) -> None:
        """ConfigError when steps an earlier process committed stay charged in addition to the
        resumed run's and the plan's charge depends on each step's position (cyclic Poisson
        groups, correlated noise): the resumed steps would sit behind them in the history, out
        of line with the groups and noise rows they really used, and the accounting would not
        hold; shuffled batches likewise (each epoch of steps is charged once). A clean stop
        (preemption, completion) or an exact replay leaves no such steps."""
        plan = self.job.privacy.plan
        if not lost or plan is None or (plan.accounting.plain
                                         and not plan.selection.steps_follow_batches):
            return
        raise ConfigError(
            f"Cannot resume the run in {str(self.run_dir)!r}: the earlier process committed "
            f"{history_steps(lost)} step(s) beyond the checkpoint that a resumed process would "
            "not replay exactly, and with "
            f"privacy.sampling={plan.selection.kind} (or correlated noise) each step is charged by "
            "its position (its sampling group or shuffled epoch, its rows of the noise), which "
            "steps charged twice would shift. Resume from a checkpoint at the last committed step (runs stopped by "
            "preemption write one), replay exactly (privacy.reproducible_mechanism=true on the "
            "CPU), or start a new run in a new folder. Nothing was changed.")

    @staticmethod
    def _recorded_data(previous: dict[str, Any], state: dict[str, Any] | None) -> list[str]:
        """The fingerprints of the training data the run's steps were computed on: the previous
        ledger's (UNKNOWN for one written before they were recorded) and the checkpoint's."""
        recorded = list(previous["dataset"].get("fingerprints", [UNKNOWN]))
        if state is not None and "data_fingerprint" in state:
            recorded.append(str(state["data_fingerprint"]))
        return list(dict.fromkeys(recorded))

    @staticmethod
    def _recorded_users(previous: dict[str, Any], state: dict[str, Any] | None) -> list[str]:
        """The fingerprints of the users of a user-level run's steps (`dataset.user_fingerprints`
        of the previous ledger, and the checkpoint's): UNKNOWN for a ledger written before they
        were recorded (an older user-level ledger never compares as the same users; the unit
        cannot change on resume, the config and the plan hold it)."""
        recorded = list(previous["dataset"].get("user_fingerprints", [UNKNOWN]))
        if state is not None and "user_fingerprint" in state:
            recorded.append(str(state["user_fingerprint"]))
        return list(dict.fromkeys(recorded))


def resume_on_every_rank(resumer: Resumer) -> None:
    """`resumer.resume()`, then one collective check that every rank resumed to the same state.

    Without a file system shared by the nodes, a rank may find no (or an older) checkpoint and
    ledger; its steps, history and noise would then differ from rank 0's. The check makes every
    rank raise (a ConfigError, or on a rank whose resume failed, its own error) instead of one
    rank failing alone while the others wait for it in a collective. It is also the point after
    which rank 0 may write the folder every rank has now read (`Resumer.record`).
    """
    failure: Exception | None = None
    try:
        resumer.resume()
    except Exception as error:  # re-raised below, once every rank knows
        failure = error
    values = {"error": f"{type(failure).__name__}: {failure}"} if failure else resumer.state()
    try:
        check_same_on_every_rank(values, "the resumed state",
                                 "every node must see the run folder (shared file system).")
    except ConfigError:
        if failure is None:
            raise
    if failure is not None:
        raise failure
