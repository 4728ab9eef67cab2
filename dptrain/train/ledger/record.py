"""The ledger of one run: `PrivacyLedger` (commit steps before they touch data, record
checkpoints, finish; every write atomic) and `run_ledger`, which describes a TrainingJob in a new
one (its mechanism read off the plan)."""

from __future__ import annotations

import datetime as _dt
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dptrain import __version__
from dptrain.accounting.history import (
    History,
    history_from_json,
    history_steps,
    history_to_json,
    merge_history,
)
from dptrain.errors import DPTrainError
from dptrain.io import atomic_write_json
from dptrain.privacy.noise import noise_class
from dptrain.train.job import TrainingJob
from dptrain.train.ledger.hashing import config_hash
from dptrain.train.ledger.schema import (
    CYCLIC_PARTITION_NOTE,
    EARLIER_REPRODUCIBLE_NOTE,
    EQUAL_SPLIT_PARTITION_NOTE,
    LEDGER_FILENAME,
    NON_PRIVATE_NOTE,
    PRIVACY_UNIT,
    REPRODUCIBLE_MECHANISM_NOTE,
    SCHEMA_VERSION,
    STATUSES,
    ZERO_OUT_PRIVACY_UNIT,
)
from dptrain.train.ledger.verification import (
    ledger_accountant,
    _as_float,
    accounting_record,
    available_accountants,
    epsilon_of,
    ledger_sampling,
)
from dptrain.train.settings import TrainSettings

def best_checkpoint_selection(checkpoint: str, validation_size: int,
                              model_file: str | None = None) -> dict[str, Any]:
    """The ledger's `model_selection` entry for a run that keeps its best checkpoint
    (`model_file`: the weights of that checkpoint written for release, model_best.pt).

    The validation examples are records of the user's private file held out of training, so
    epsilon (a guarantee for the N training examples) does not cover them, and choosing the
    checkpoint on them is not covered either: the chosen weights are not safe to share as a
    private model (`safe_to_share`: false). dptrain does not select privately.
    """
    chosen = checkpoint if model_file is None else f"{checkpoint} (and {model_file}, its weights)"
    return {
        "checkpoint": checkpoint,
        **({} if model_file is None else {"model_file": model_file}),
        "criterion": "highest validation accuracy",
        "validation_size": int(validation_size),
        "covered_by_epsilon": False,
        "safe_to_share": False,
        "note": (f"{chosen} is chosen by its accuracy on the {int(validation_size)} "
                 "validation examples held out of the training split (not counted in "
                 "dataset.size). They never enter training, but the choice depends on them: "
                 "epsilon covers the training examples only, not this choice. Not safe to "
                 "share as a private model: release model.pt (the final weights) instead."),
    }


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- the ledger
class PrivacyLedger:
    """In-memory ledger of one run, written atomically to `run_dir/privacy_ledger.json`.

    The trainer calls `commit` before each block of steps, `record_checkpoint` after each
    checkpoint and `finish` at the end. `history` passed in is always the full history in runs of
    (sigma, q, steps); `steps_completed` counts the steps known to have finished.
    """

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = Path(path)
        self.data = data

    @classmethod
    def create(
        cls,
        run_dir: Path,
        *,
        config: dict[str, Any],
        dataset_name: str,
        dataset_size: int,
        mechanism: dict[str, Any] | None,
        accountant: str | None,
        plan: dict[str, Any] | None = None,
        target_epsilon: float | None,
        delta: float | None,
        validation_size: int = 0,
        private_preprocessing: Sequence[str] = (),
        model_selection: dict[str, Any] | None = None,
        synthetic: bool = False,
    ) -> PrivacyLedger:
        """A fresh ledger (status "running", empty history); `mechanism=None` is non-private.

        `dataset_size` is N, the training examples; `validation_size` the examples held out of
        them; `private_preprocessing` one sentence per preprocessing step that read the training
        examples, saying what epsilon covers of it (empty: none); `model_selection` what
        `best_checkpoint_selection` says (None: no selection); `synthetic` that the examples are
        seeded random data, not the dataset's.
        """
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "dptrain_version": __version__,
            "updated": _now(),
            "status": "running",
            "private": mechanism is not None,
            "config": config,
            "config_hash": config_hash(config),
            "dataset": {"name": dataset_name, "size": int(dataset_size),
                        "validation_size": int(validation_size),
                        "private_preprocessing": [str(step) for step in private_preprocessing],
                        "synthetic": bool(synthetic)},
            "model_selection": model_selection,
            "mechanism": mechanism,
            "plan": plan,
            "accountant": accountant,
            "target": {"epsilon": target_epsilon, "delta": delta},
            "delta": delta,
            "history": [],
            "steps_completed": 0,
            "committed_ahead": 0,
            "epsilon": 0.0 if mechanism is not None else None,
            "epsilon_by_accountant": {},
            "checkpoints": [],
            "resumes": [],
            "error": None,
        }
        if mechanism is None:
            data["note"] = NON_PRIVATE_NOTE
        return cls(Path(run_dir) / LEDGER_FILENAME, data)

    # -- properties ----------------------------------------------------------------------------
    @property
    def private(self) -> bool:
        return bool(self.data["private"])

    @property
    def history(self) -> History:
        return history_from_json(self.data["history"])

    @property
    def epsilon(self) -> float | None:
        return _as_float(self.data["epsilon"])

    # -- updates -------------------------------------------------------------------------------
    def commit(self, history: History, steps_completed: int) -> None:
        """Record `history` (done steps + steps about to run) with status "running"; write.

        `committed_ahead` is the number of steps in the history that have not finished yet.
        """
        self._set_history(history, steps_completed)
        self.data["status"] = "running"
        self.write()

    def record_checkpoints(self, paths: list[str], step: int, epoch: int, done: History,
                           steps_completed: int | None = None) -> None:
        """Add one entry per checkpoint file of the same state (at logical step `step`, with the
        epsilon of `done`: every step spent so far); one write. `steps_completed` (default
        `step`) also counts steps of earlier processes kept charged."""
        eps = self._claim(merge_history(done)) if self.private else None
        completed = int(step if steps_completed is None else steps_completed)
        total = history_steps(self.history) if self.private else completed
        self.data["steps_completed"] = completed
        self.data["committed_ahead"] = total - completed
        self._mark_gone(paths)   # an earlier state under the same name was overwritten
        self.data["checkpoints"] += [{"path": path, "step": int(step), "epoch": int(epoch),
                                      "epsilon": eps, "exists": True} for path in paths]
        self.write()

    def add_found_checkpoint(self, path: str, step: int, epoch: int, spent: History) -> None:
        """On resume: add the entry of a checkpoint file an earlier process wrote but was
        stopped before recording (dptrain.train.checkpoint.unrecorded_checkpoints), at logical
        step `step` with the epsilon of `spent` (the steps its state had spent), marked
        `found_on_resume`; an older entry of the same name is folded as overwritten. Not
        written here: the resume's commit writes the ledger."""
        self._mark_gone([path])
        eps = self._claim(merge_history(spent)) if self.private else None
        self.data["checkpoints"].append({"path": path, "step": int(step), "epoch": int(epoch),
                                         "epsilon": eps, "exists": True,
                                         "found_on_resume": True})

    def existing_checkpoints(self) -> list[str]:
        """The checkpoint files the run folder holds, as the ledger knows them, oldest written
        first (entries without `exists`, from older ledgers, count as existing)."""
        paths = [c["path"] for c in self.data["checkpoints"] if c.get("exists", True)]
        return list(dict.fromkeys(reversed(paths)))[::-1]   # each path where it was last written

    def record_deleted(self, paths: Sequence[str]) -> None:
        """Note that the checkpoint files `paths` were deleted; one write. Their entries are
        folded into `pruned_checkpoints` (`_mark_gone`), and every step in `history` stays charged
        whatever files remain."""
        self._mark_gone(paths)
        self.write()

    def carry_checkpoints(self, previous: dict[str, Any]) -> None:
        """On resume: keep the earlier process's record of the checkpoints written (the files stay
        on disk: the record stays), the entries of files gone folded as `_mark_gone` does."""
        self.data["checkpoints"] = list(previous["checkpoints"])
        if "pruned_checkpoints" in previous:
            self.data["pruned_checkpoints"] = dict(previous["pruned_checkpoints"])
        self._mark_gone(())

    def _mark_gone(self, paths: Sequence[str]) -> None:
        """Fold the entries of `paths`, and of files already known gone (`exists: false`, from
        older ledgers), into `pruned_checkpoints`: their count, and the largest step and epsilon
        any of them recorded (what the run's records are checked against: ledger_check). The
        entries of files on disk stay as they are."""
        gone = set(paths)
        kept, pruned = [], []
        for entry in self.data["checkpoints"]:
            is_gone = entry["path"] in gone or entry.get("exists") is False
            (pruned if is_gone else kept).append(entry)
        if not pruned:
            return
        summary = self.data.get("pruned_checkpoints") or {"count": 0, "max_step": 0,
                                                          "max_epsilon": None}
        epsilons = [_as_float(e["epsilon"]) for e in pruned if e["epsilon"] is not None]
        if summary["max_epsilon"] is not None:
            epsilons.append(_as_float(summary["max_epsilon"]))
        self.data["checkpoints"] = kept
        self.data["pruned_checkpoints"] = {
            "count": summary["count"] + len(pruned),
            "max_step": max([summary["max_step"], *(int(e["step"]) for e in pruned)]),
            "max_epsilon": max(epsilons, default=None)}

    def record_resume(self, checkpoint: str | None, step: int, discarded: int = 0,
                      charged: int = 0) -> None:
        """Note a resume from `checkpoint` (None: a restart from step 0) at logical step `step`.

        Of the steps an earlier process had committed beyond that point, `discarded` are retaken
        by an exact replay (the same computation, charged once: they stay in the history until
        the resumed run retakes them, and for good if it stops before them) and `charged` stay
        in the history in addition to the retaken steps (their replay differs: secure mode, a
        restart from another starting state, other training data, a device other than the CPU;
        train/replay.py).
        """
        self.data["resumes"].append({"checkpoint": checkpoint, "step": int(step),
                                     "discarded_committed_steps": int(discarded),
                                     "charged_steps": int(charged), "time": _now()})

    def finish(self, status: str, history: History, steps_completed: int,
               error: str | None = None) -> None:
        """Final write: the exact history, the epsilon under every accountant, the status."""
        if status not in STATUSES:
            raise ValueError(f"unknown ledger status {status!r}")
        self._set_history(history, steps_completed)
        self.data["status"] = status
        self.data["error"] = error
        if self.private:
            self.data["epsilon_by_accountant"] = self._all_claims(self.history)
        self.write()

    def record_audit(self, audit: dict[str, Any]) -> None:
        """Note that the run was audited (`dptrain audit`) and what the audit found; one write."""
        self.data["audit"] = audit
        self.write()

    def write(self) -> None:
        """Atomically write the ledger to `self.path`."""
        self.data["updated"] = _now()
        atomic_write_json(self.path, self.data)

    # -- internals -----------------------------------------------------------------------------
    def _set_history(self, history: History, steps_completed: int) -> None:
        history = merge_history(history) if self.private else []
        total = history_steps(history) if self.private else int(steps_completed)
        if steps_completed > total:
            raise ValueError(f"steps_completed={steps_completed} exceeds the history ({total})")
        self.data["history"] = history_to_json(history)
        self.data["steps_completed"] = int(steps_completed)
        self.data["committed_ahead"] = total - int(steps_completed)
        if self.private:
            self.data["epsilon"] = self._claim(history)
            charge = accounting_record(self.data, history)
            if charge is not None:
                self.data["accounting"] = charge

    def _claim(self, history: History) -> float:
        return epsilon_of(history, self.data["delta"], self.data["accountant"],
                          ledger_sampling(self.data))

    def _all_claims(self, history: History) -> dict[str, dict[str, Any]]:
        claims: dict[str, dict[str, Any]] = {}
        for name in available_accountants():
            try:
                with warnings.catch_warnings():  # gdp warns it is approximate: labelled below
                    warnings.simplefilter("ignore", UserWarning)
                    eps: float | None = epsilon_of(history, self.data["delta"], name,
                                                   ledger_sampling(self.data))
                error = None
            except (DPTrainError, ValueError, ArithmeticError) as err:  # does not apply here
                eps, error = None, f"{type(err).__name__}: {err}"
            # the selection's own accountant (shuffle, balls-in-bins) is exact whatever the name
            approximate = ledger_accountant(self.data, name).approximate
            claims[name] = {"epsilon": eps, "approximate": bool(approximate)}
            if error:
                claims[name]["error"] = error
        return claims


# ----------------------------------------------------------------------------- a job's ledger
def run_delta(job: TrainingJob) -> float | None:
    """The delta epsilon is reported at: the plan's (privacy.target_delta, else 1/(10 N) rounded
    down, filled in by the plan); None when non-private."""
    return None if job.engine is None else job.privacy.target_delta


def algorithm_and_noise(strategy: str) -> tuple[str, str]:
    """The ledger's `algorithm` and `noise` for the noise strategy named `strategy`, in its own
    words (dptrain.privacy.noise): independent Gaussian noise each step is DP-SGD; noise
    correlated across steps by a Toeplitz matrix C is DP-SGD with matrix-factorization noise
    (DP-MF), its parameters in the recorded plan's noise.strategy."""
    cls = noise_class(strategy)
    return cls.algorithm, cls.noise_words


def mechanism(job: TrainingJob) -> dict[str, Any]:
    """The ledger's summary of the mechanism (DP-SGD with its sampling, clipping, noise), read
    off the plan; the full plan is recorded beside it (`plan`)."""
    plan = job.privacy.plan
    norm = plan.clipping.max_grad_norm
    algorithm, noise = algorithm_and_noise(plan.noise.strategy.name)
    described: dict[str, Any] = {
        "algorithm": algorithm,
        "privacy_unit": plan.unit.privacy_unit(plan.selection),  # under the selection's relation
        "sampling": plan.selection.description,
        # amplified by (cyclic) Poisson sampling: a noise column of at most `groups` bands
        "amplified": plan.selection.amplified and plan.accounting.amplified(
            plan.selection.groups + 1),
        "clipping": plan.clipping.kind,
        "max_grad_norm": list(norm) if isinstance(norm, tuple) else norm,
        "noise": noise,
        "noise_multiplier": plan.noise.multiplier,
        "sample_rate": plan.selection.sample_rate,
        "expected_batch_size": plan.expected_batch_size(job.engine.dataset_size),  # q N: N units
        "secure_mode": plan.secure,
        "randomness": job.engine.randomness(),
        "grad_sample_mode": job.privacy.performance.grad_sample_mode,
        "noise_schedule": dict(plan.noise.schedule or {}),
    }
    if plan.selection.takes_groups:  # why add/remove holds for its drawn groups
        described["sampling_partition"] = CYCLIC_PARTITION_NOTE
    described.update(plan.unit.ledger_entries(job.engine.data_loader))  # users: N, cap
    if described["randomness"] == "reproducible":
        described["randomness_note"] = REPRODUCIBLE_MECHANISM_NOTE
    strategies = layer_strategies(job.model)
    if strategies is not None:
        described["layer_strategies"] = strategies
    return described


def recorded_randomness(mechanism: dict[str, Any] | None) -> str | None:
    """A ledger's mechanism.randomness; for a ledger written before it was recorded, what that
    code did: sampling coins seeded from train.seed ("reproducible") outside secure mode. None
    when non-private."""
    if not mechanism:
        return None
    if "randomness" in mechanism:
        return str(mechanism["randomness"])
    return "secure" if mechanism.get("secure_mode") else "reproducible"


def carry_randomness(previous: dict[str, Any] | None, mechanism: dict[str, Any] | None) -> None:
    """On resume: a run whose earlier process seeded its mechanism from train.seed stays flagged
    "reproducible" in `mechanism` (with EARLIER_REPRODUCIBLE_NOTE), whatever the resumed process
    does: the steps already released are no guarantee against whoever knows the seed."""
    if (mechanism is None or mechanism.get("randomness") == "reproducible"
            or recorded_randomness(previous) != "reproducible"):
        return
    mechanism["randomness"] = "reproducible"
    mechanism["randomness_note"] = EARLIER_REPRODUCIBLE_NOTE


def carry_partition(previous: dict[str, Any] | None, mechanism: dict[str, Any] | None) -> None:
    """On resume: a cyclic Poisson run whose earlier process recorded no CYCLIC_PARTITION_NOTE
    drew equal-size groups, which its checkpoints keep (dptrain.data.cyclic_sampling): the
    ledger says so in `mechanism`, and an example-level unit becomes the zero-out one that
    split supports (add/remove does not hold for it)."""
    if (mechanism is None or "sampling_partition" not in mechanism or not previous
            or previous.get("sampling") != mechanism.get("sampling")
            or previous.get("sampling_partition") == CYCLIC_PARTITION_NOTE):
        return
    mechanism["sampling_partition"] = EQUAL_SPLIT_PARTITION_NOTE
    if mechanism.get("privacy_unit") == PRIVACY_UNIT:
        mechanism["privacy_unit"] = ZERO_OUT_PRIVACY_UNIT


def layer_strategies(model: nn.Module) -> dict[str, str] | None:
    """The per-layer clipping choices of a ghost-clipping model ({layer: "ghost" |
    "instantiate"}, filled in as batches are seen); None for a model without them."""
    strategies = getattr(model, "layer_strategies", None)
    if not callable(strategies):
        return None
    return {str(k): str(v) for k, v in dict(strategies()).items()}


def refresh_layer_strategies(ledger: PrivacyLedger, model: nn.Module) -> None:
    """Ghost clipping decides per-layer strategies on the batches it sees: record them."""
    strategies = layer_strategies(model) if ledger.private else None
    if strategies is not None:
        ledger.data["mechanism"]["layer_strategies"] = strategies


def run_ledger(job: TrainingJob, settings: TrainSettings, run_dir: Path,
               best_checkpoint: str, best_model_file: str | None = None) -> PrivacyLedger:
    """A fresh ledger describing `job` (not yet written); `best_checkpoint` is the file
    `train.keep_best` keeps, `best_model_file` the weights written beside it."""
    private = job.engine is not None
    validation_size = 0 if job.validation_loader is None else len(job.validation_loader.dataset)
    return PrivacyLedger.create(
        run_dir, config=job.config, dataset_name=job.dataset_name,
        dataset_size=job.dataset_size, mechanism=mechanism(job) if private else None,
        accountant=job.privacy.plan.accountant if private else None,
        plan=job.privacy.plan.to_dict() if private else None,
        target_epsilon=job.privacy.target_epsilon, delta=run_delta(job),
        validation_size=validation_size, private_preprocessing=job.private_preprocessing,
        model_selection=best_checkpoint_selection(best_checkpoint, validation_size,
                                                  best_model_file)
        if settings.keep_best else None, synthetic=job.synthetic)
