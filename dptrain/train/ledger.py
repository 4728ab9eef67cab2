"""The privacy ledger: an auditable, crash-safe record of what a run spent.

`privacy_ledger.json` (schema version `SCHEMA_VERSION`, documented in docs/ledger.md) holds the
resolved config and its hash, the dataset, its size N and the fingerprint of its contents, the
mechanism, the accountant, the target (epsilon, delta), the history of steps as runs of identical
(noise_multiplier, sample_rate), the epsilon it implies under every accountant, the status and the
checkpoints written. Every write is atomic (`dptrain.io.atomic_write_json`).

The trainer commits steps to the history BEFORE they touch data, so a ledger left by a killed
process never under-reports: `steps_completed + committed_ahead == sum(history steps)`.
Claimed epsilons are always `compute_epsilon(history, delta, accountant)` of the stored history,
so `verify_ledger` can recompute them exactly. `run_ledger` describes a TrainingJob in a new one.
"""

from __future__ import annotations

import copy
import datetime as _dt
import functools
import hashlib
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
from torch import nn

from dptrain import __version__
from dptrain.accounting import ACCOUNTANTS, compute_epsilon
from dptrain.accounting.events import AccountingEvent
from dptrain.accounting.history import (  # noqa: F401  (re-exported: the ledger's history API)
    History,
    history_from_json,
    history_steps,
    history_to_json,
    merge_history,
    truncate_history,
)
from dptrain.checks import default_delta  # noqa: F401  (re-exported: where it was)
from dptrain.distributed.consistency import flatten
from dptrain.errors import ConfigError, DPTrainError
from dptrain.io import atomic_write_json, json_safe
from dptrain.privacy.plan import PrivacyPlan
from dptrain.privacy.user_level import privacy_unit_of, user_level_mechanism
from dptrain.train.job import TrainingJob
from dptrain.train.ledger_check import edited_ledger_error, first_mismatch, record_mismatches
from dptrain.train.settings import TrainSettings

SCHEMA_VERSION = 2
# Versions `load_ledger` reads: 1 (before the plan was recorded: Poisson sampling) and 2 (`plan`).
READABLE_VERSIONS = (1, 2)
LEDGER_FILENAME = "privacy_ledger.json"
# "interrupted": stopped by Ctrl-C (SIGINT); "preempted": stopped by SIGTERM or SIGUSR1 after a
# whole step, checkpointed (dptrain.train.preemption); "failed": stopped by an error.
STATUSES = ("running", "completed", "stopped_at_budget", "interrupted", "preempted", "failed")
# What epsilon protects: DP-SGD with Poisson sampling is accounted for add/remove adjacency.
PRIVACY_UNIT = "one training example (add/remove: datasets differing by one example)"
# What epsilon protects with shuffled batches (dptrain.accounting.shuffle).
SHUFFLE_PRIVACY_UNIT = ("one training example (substitution: datasets of the same size differing "
                        "in one example; no amplification by subsampling)")
NON_PRIVATE_NOTE = "non-private: no privacy guarantee"
# mechanism.randomness: how the noise and the Poisson sampling coins were seeded.
RANDOMNESS = ("os_entropy", "secure", "reproducible")
# mechanism.randomness_note of a run with a reproducible mechanism
# (privacy.reproducible_mechanism=true).
REPRODUCIBLE_MECHANISM_NOTE = (
    "reproducible mechanism: NOT a guarantee if the seed is known. Anyone who knows the seed of "
    "the noise and sampling generators (with the dptrain command: derived from train.seed, which "
    "this ledger's config records) or holds a checkpoint (it stores the generators' states) can "
    "regenerate the noise and subtract it from the released model, and can tell which examples "
    "were in each batch, which the amplification by subsampling behind this epsilon assumes is "
    "secret.")
# mechanism.randomness_note of a resumed run whose earlier process seeded its mechanism from
# train.seed, when the resumed process does not.
EARLIER_REPRODUCIBLE_NOTE = (
    "an earlier process of this run drew its Poisson sampling coins (and with "
    "privacy.reproducible_noise=true or privacy.reproducible_mechanism=true its noise) from "
    "generators seeded from train.seed; a ledger written before mechanism.randomness was recorded "
    "always did outside secure mode. For those steps: " + REPRODUCIBLE_MECHANISM_NOTE)
APPROXIMATE_ACCOUNTANTS = frozenset({"gdp"})  # CLT approximation, not an upper bound
# Config keys that may change between a run and its resume without changing what is trained.
RESUME_EXEMPT_KEYS = ("train.resume", "train.progress", "train.max_steps", "train.run_dir",
                      "train.keep_checkpoints", "train.wait_for_lock", "hydra", "logger")
# Config keys renamed since a ledger or checkpoint was written: {old name: new name}. A resume
# compares the recorded values under their new names. privacy.reproducible_noise=true seeded the
# noise and the sampling from train.seed, as reproducible_mechanism=true does; =false seeded the
# sampling alone (now from OS entropy too: the resumed steps are not less private, and
# `carry_randomness` keeps the ledger's flag).
RENAMED_KEYS = {"privacy.reproducible_noise": "privacy.reproducible_mechanism"}
# Config keys added since a ledger or checkpoint was written: {key: the value every earlier run
# had, which means what the older config did}. A key at that value is hashed as absent, so those
# runs still resume. privacy.sampling null defers to privacy.poisson_sampling, as before; the
# privacy unit was one example, no dataset named users; the learning rate was constant; the
# noise was independent.
ADDED_KEYS: dict[str, Any] = {"privacy.sampling": None, "privacy.sampling_groups": None,
                              "privacy.unit": "example",
                              "privacy.max_examples_per_user": None, "dataset.user_column": None,
                              "lr_schedule.kind": "constant", "privacy.noise": "independent",
                              "privacy.noise_bands": None, "privacy.noise_buffers": None}


_NUMBER_OR_INF = {"type": ["number", "string", "null"], "pattern": "^(-?inf|nan)$"}
_HISTORY_RUN = {
    "type": "object",
    "required": ["noise_multiplier", "sample_rate", "steps"],
    "properties": {
        "noise_multiplier": {"type": "number", "minimum": 0},
        "sample_rate": {"type": "number", "minimum": 0, "maximum": 1},
        "steps": {"type": "integer", "minimum": 1},
    },
}
LEDGER_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dptrain privacy ledger",
    "type": "object",
    "required": [
        "schema_version", "dptrain_version", "updated", "status", "private", "config",
        "config_hash", "dataset", "mechanism", "accountant", "target", "delta", "history",
        "steps_completed", "committed_ahead", "epsilon", "epsilon_by_accountant", "checkpoints",
        "resumes",
    ],
    "properties": {
        "schema_version": {"type": "integer", "enum": list(READABLE_VERSIONS)},
        # the run's PrivacyPlan.to_dict() (version 2; null when non-private; absent in version 1,
        # whose runs used Poisson sampling)
        "plan": {"type": ["object", "null"],
                 "properties": {"selection": {"type": "object", "required": ["kind", "sample_rate"]}}},
        "dptrain_version": {"type": "string"},
        "updated": {"type": "string"},
        "status": {"type": "string", "enum": list(STATUSES)},
        "private": {"type": "boolean"},
        "note": {"type": "string"},
        "error": {"type": ["string", "null"]},
        "config": {"type": "object"},
        "config_hash": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "dataset": {
            "type": "object",
            "required": ["name", "size"],
            "properties": {"name": {"type": "string"}, "size": {"type": "integer", "minimum": 0},
                           "validation_size": {"type": "integer", "minimum": 0},
                           # seeded random data (dataset.synthetic=true), not the real examples
                           "synthetic": {"type": "boolean"},
                           # preprocessing that read the private training data (outside
                           # epsilon); absent in ledgers written before it was recorded
                           "private_preprocessing": {"type": "array",
                                                     "items": {"type": "string"}},
                           # the SHA-256 of the training data of every process of the run
                           # (dptrain.data.fingerprint; "unknown": not hashed), in the order
                           # first used; absent in ledgers written before it was recorded
                           "fingerprints": {"type": "array", "minItems": 1, "items": {
                               "type": "string", "pattern": "^([0-9a-f]{64}|unknown)$"}}},
        },
        "model_selection": {
            "type": ["object", "null"],
            "required": ["checkpoint", "criterion", "validation_size", "covered_by_epsilon",
                         "note"],
            "properties": {"checkpoint": {"type": "string"}, "criterion": {"type": "string"},
                           "validation_size": {"type": "integer", "minimum": 1},
                           "covered_by_epsilon": {"type": "boolean", "enum": [False]},
                           "note": {"type": "string"}},
        },
        "mechanism": {
            "type": ["object", "null"],
            # randomness: absent in ledgers written before it was recorded
            "properties": {"randomness": {"type": "string", "enum": list(RANDOMNESS)},
                           "randomness_note": {"type": "string"}},
        },
        "accountant": {"type": ["string", "null"]},
        "target": {
            "type": "object",
            "required": ["epsilon", "delta"],
            "properties": {"epsilon": {"type": ["number", "null"]},
                           "delta": {"type": ["number", "null"]}},
        },
        "delta": {"type": ["number", "null"]},
        "history": {"type": "array", "items": _HISTORY_RUN},
        "steps_completed": {"type": "integer", "minimum": 0},
        "committed_ahead": {"type": "integer", "minimum": 0},
        "epsilon": _NUMBER_OR_INF,
        "epsilon_by_accountant": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["epsilon", "approximate"],
                "properties": {"epsilon": _NUMBER_OR_INF, "approximate": {"type": "boolean"}},
            },
        },
        "checkpoints": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["path", "step", "epoch", "epsilon"],
                "properties": {"path": {"type": "string"}, "step": {"type": "integer"},
                               "epoch": {"type": "integer"}, "epsilon": _NUMBER_OR_INF,
                               # false once the file no longer holds this state (deleted by
                               # train.keep_checkpoints, or overwritten by a later checkpoint of
                               # the same name); absent in ledgers written before it was kept
                               "exists": {"type": "boolean"}},
            },
        },
        # the entries of checkpoint files no longer on disk, folded into a count with the largest
        # step and epsilon among them; absent in ledgers written before, which kept each entry
        # (`exists: false`)
        "pruned_checkpoints": {
            "type": "object",
            "required": ["count", "max_step", "max_epsilon"],
            "properties": {"count": {"type": "integer", "minimum": 0},
                           "max_step": {"type": "integer", "minimum": 0},
                           "max_epsilon": _NUMBER_OR_INF},
        },
        "resumes": {"type": "array", "items": {"type": "object"}},
        "start_fingerprint": {"type": ["string", "null"]},
        # an audited run (dptrain audit): what the audit found; absent when not audited
        "audit": {
            "type": "object",
            "required": ["file", "kind", "canaries", "claimed_epsilon", "lower_bound",
                         "confidence", "violation", "verdict"],
            "properties": {"file": {"type": "string"}, "kind": {"type": "string"},
                           "canaries": {"type": "integer", "minimum": 1},
                           "claimed_epsilon": _NUMBER_OR_INF,
                           "lower_bound": {"type": "number", "minimum": 0},
                           "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "violation": {"type": "boolean"}, "verdict": {"type": "string"}},
        },
        "devices": {"type": "array", "items": {"type": "string"}},
    },
}


# ----------------------------------------------------------------------------- config hashing
def _hashed_items(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened config without the keys that may change on resume (RESUME_EXEMPT_KEYS) and
    the ADDED_KEYS at the value earlier runs had."""
    def exempt(key: str, value: Any) -> bool:
        return (any(key == k or key.startswith(k + ".") for k in RESUME_EXEMPT_KEYS)
                or (key in ADDED_KEYS and ADDED_KEYS[key] == value))

    return {k: v for k, v in flatten(config).items() if not exempt(k, v)}


def config_hash(config: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of the config, RESUME_EXEMPT_KEYS left out."""
    canonical = json.dumps(json_safe(_hashed_items(config)), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs (hashed keys only; the old config's
    RENAMED_KEYS under their new names, its missing ADDED_KEYS at their old meaning), sorted."""
    a = {RENAMED_KEYS.get(k, k): v for k, v in json_safe(_hashed_items(old)).items()}
    b = json_safe(_hashed_items(new))
    a.update({k: v for k, v in ADDED_KEYS.items() if k not in a and k in b})
    return sorted(k for k in set(a) | set(b) if a.get(k, "<missing>") != b.get(k, "<missing>"))


def same_config(recorded_hash: str, recorded: dict[str, Any], config: dict[str, Any]) -> bool:
    """True when `config` is the recorded run's config: the same hash, or the same values (a
    typed config reads `optimizer.lr=1` as 1.0 where an untyped one kept 1: same run)."""
    return recorded_hash == config_hash(config) or not config_differences(recorded, config)


def epsilon_of(history: History, delta: float, accountant: str,
               sampling: str | AccountingEvent = "poisson") -> float:
    """Epsilon of `history` at `delta` under `accountant` for steps charged as `sampling`
    (poisson | shuffle, or the plan's AccountingEvent: `ledger_sampling`); 0.0 for an empty
    history.

    Memoized (the ledger, the guard and the metrics ask for the same histories repeatedly).
    """
    if not history:
        return 0.0
    key = tuple((float(s), float(q), int(n)) for s, q, n in history)
    return _cached_epsilon(key, float(delta), accountant, sampling)


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(history: tuple[tuple[float, float, int], ...], delta: float,
                    accountant: str, sampling: str | AccountingEvent) -> float:
    return float(compute_epsilon(list(history), delta, accountant=accountant, sampling=sampling))


def ledger_sampling(data: dict[str, Any]) -> str | AccountingEvent:
    """How a ledger's history is charged: the recorded plan's AccountingEvent (its selection,
    sampling groups and noise strategy, rebuilt from the strategy's recorded parameters), or
    "poisson" for a ledger without a plan (a version-1 ledger's runs used Poisson sampling)."""
    plan = data.get("plan")
    if not plan:
        return "poisson"
    return PrivacyPlan.from_dict(plan).accounting


def accounting_record(data: dict[str, Any], history: History) -> dict[str, Any] | None:
    """What the ledger records of how its history is charged when that is not plain DP-SGD
    (cyclic Poisson sampling or correlated noise): the selection, groups, neighbouring
    relation, whether amplified, the sensitivity of the noise strategy (units of clip) and the
    participation schema (dptrain.accounting.events.AccountingEvent.describe); None otherwise."""
    event = ledger_sampling(data)
    if not isinstance(event, AccountingEvent) or event.plain:
        return None
    key = tuple((float(s), float(q), int(n)) for s, q, n in history)
    return copy.deepcopy(_cached_describe(event, key))


@functools.lru_cache(maxsize=256)
def _cached_describe(event: AccountingEvent,
                     history: tuple[tuple[float, float, int], ...]) -> dict[str, Any]:
    return event.describe(list(history))


def best_checkpoint_selection(checkpoint: str, validation_size: int) -> dict[str, Any]:
    """The ledger's `model_selection` entry for a run that keeps its best checkpoint.

    The validation examples never enter training, so epsilon (a guarantee for the N training
    examples) does not cover them, and choosing the checkpoint on them is not covered either.
    """
    return {
        "checkpoint": checkpoint,
        "criterion": "highest validation accuracy",
        "validation_size": int(validation_size),
        "covered_by_epsilon": False,
        "note": (f"{checkpoint} is chosen by its accuracy on the {int(validation_size)} "
                 "validation examples held out of the training split (not counted in "
                 "dataset.size). They never enter training, but the choice depends on them: "
                 "epsilon covers the training examples only, not this choice."),
    }


def available_accountants() -> list[str]:
    """Names of the registered accountants (dptrain.accounting.ACCOUNTANTS)."""
    return sorted(ACCOUNTANTS)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _as_float(value: Any) -> float | None:
    """Read back an epsilon written by `dptrain.io` ("inf" strings become floats)."""
    if value is None:
        return None
    return float(value)


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
        examples (not covered by epsilon; empty: none); `model_selection` what
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
            claims[name] = {"epsilon": eps, "approximate": name in APPROXIMATE_ACCOUNTANTS}
            if error:
                claims[name]["error"] = error
        return claims


# ----------------------------------------------------------------------------- reading, validation
def schema_errors(value: Any, schema: dict[str, Any] = LEDGER_SCHEMA) -> list[str]:
    """Violations of `schema` (JSON Schema 2020-12, checked by `jsonschema`), each as
    "path: message", in document order; [] when `value` is valid."""
    validator = jsonschema.Draft202012Validator(schema)
    found = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<ledger>'}: {e.message}" for e in found]


def consistency_errors(data: dict[str, Any]) -> list[str]:
    """Cross-field checks the schema cannot express (step counts, config hash)."""
    errors: list[str] = []
    total = history_steps(history_from_json(data["history"]))
    if data["private"] and data["steps_completed"] + data["committed_ahead"] != total:
        errors.append(f"steps_completed ({data['steps_completed']}) + committed_ahead "
                      f"({data['committed_ahead']}) != steps in history ({total})")
    if config_hash(data["config"]) != data["config_hash"]:
        errors.append("config_hash does not match the config stored in the ledger")
    if data["private"] and (data["accountant"] is None or data["delta"] is None):
        errors.append("a private ledger needs an accountant and a delta")
    return errors


def load_ledger(path: Path | str, check_records: bool = False) -> dict[str, Any]:
    """Read and validate a ledger file (or a run folder holding one).

    Raises ConfigError naming the file when it is missing, truncated, not JSON, of another schema
    version or inconsistent, and with `check_records` when a record of the run shows more steps
    or epsilon than its history (`records_beyond_history`); the file is never modified.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LEDGER_FILENAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"No privacy ledger at {str(path)!r}: pass a run folder or its "
                          f"{LEDGER_FILENAME}.") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"The privacy ledger {str(path)!r} is corrupt or truncated ({err}); "
                          "it cannot be trusted. Restore it from a backup, or start a new run "
                          "in a new folder (hydra.run.dir); the steps it recorded are spent, "
                          "and a run without it would not count them.") from err
    problems = schema_errors(data)
    if not problems:
        problems = consistency_errors(data)
    if problems:
        raise ConfigError(f"The privacy ledger {str(path)!r} does not match schema version "
                          f"{data.get('schema_version', SCHEMA_VERSION)}: " + "; ".join(problems[:5]) + ". It was written by "
                          "another dptrain version or edited by hand; it cannot be verified.")
    mismatches = records_beyond_history(path, data) if check_records else []
    if mismatches:
        raise edited_ledger_error(path, mismatches)
    return data


def records_beyond_history(path: Path | str, data: dict[str, Any]) -> list[str]:
    """The records of the run (dptrain.train.ledger_check: the ledger's checkpoint entries and
    resumes, metrics.jsonl and result.json beside the ledger file `path`) that show more steps,
    or a larger epsilon under the run's accountant, than the ledger `data`'s history; [] for a
    non-private ledger (it claims no epsilon)."""
    if not data["private"]:
        return []
    path = Path(path)
    run_dir = path if path.is_dir() else path.parent
    history = history_from_json(data["history"])
    return record_mismatches(run_dir, data, history_steps(history),
                             epsilon_of(history, data["delta"], data["accountant"],
                                        ledger_sampling(data)))


def accounting_mismatches(data: dict[str, Any], history: History) -> list[str]:
    """The recorded `accounting` (sensitivity, participation schema) where it differs from the
    one recomputed from the recorded plan and history, as one "accounting: ..." line; []
    when they agree (or neither is recorded)."""
    recorded, recomputed = data.get("accounting"), accounting_record(data, history)
    if recorded is None and recomputed is None:
        return []
    if recorded is not None and recomputed is not None and all(
            _same_value(recorded.get(k), v) for k, v in recomputed.items()):
        return []
    return [f"accounting: records {recorded!r}, the plan and history give {recomputed!r}"]


def _same_value(a: Any, b: Any) -> bool:
    """Equal JSON values, floats to a relative 1e-9."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


@dataclass
class Verification:
    """Result of re-computing a ledger's epsilon with one accountant."""

    path: Path
    accountant: str | None
    claimed: float | None        # the ledger's claim for that accountant (None: no claim)
    recomputed: float | None     # compute_epsilon(history, delta, accountant)
    ok: bool
    message: str
    # the run's records showing more steps or epsilon than the history (records_beyond_history)
    records: list[str] = field(default_factory=list)


def _claim_for(data: dict[str, Any], accountant: str) -> float | None:
    if accountant == data["accountant"]:
        return _as_float(data["epsilon"])
    entry = data["epsilon_by_accountant"].get(accountant)
    return None if entry is None else _as_float(entry["epsilon"])


def verify_ledger(path: Path | str, accountant: str | None = None,
                  rel_tol: float = 1e-6) -> Verification:
    """Recompute epsilon from a ledger's history, compare with what it claims, and check the
    history against the run's other records.

    `accountant=None` uses the run's accountant. `ok` is False when the claim differs from the
    recomputation by more than `rel_tol` (relative), or when a record of the run (its checkpoint
    entries, resumes, metrics.jsonl, result.json: `records_beyond_history`) shows more steps or
    epsilon than the history. A non-private ledger is ok with no epsilon.
    """
    data = load_ledger(path)
    path = Path(path)
    if not data["private"]:
        return Verification(path, None, None, None, True, NON_PRIVATE_NOTE)
    name = accountant or data["accountant"]
    if name not in available_accountants():
        raise ConfigError(f"Unknown accountant {name!r} (--accountant); choose one of "
                          f"{available_accountants()}.")
    history = history_from_json(data["history"])
    recomputed = epsilon_of(history, data["delta"], name, ledger_sampling(data))
    claimed = _claim_for(data, name)
    records = records_beyond_history(path, data) + accounting_mismatches(data, history)
    if claimed is None:
        message = f"no claim under {name!r} in the ledger; recomputed only"
        same = True
    else:
        same = (claimed == recomputed) or math.isclose(claimed, recomputed, rel_tol=rel_tol,
                                                       abs_tol=0.0)
        message = ("matches" if same else
                   f"MISMATCH: claims {claimed!r}, history gives {recomputed!r}")
    if records:
        message = (f"{message}; " if not same else "") + f"MISMATCH: {first_mismatch(records)}"
    return Verification(path, name, claimed, recomputed, same and not records, message, records)


# ----------------------------------------------------------------------------- a job's ledger
def run_delta(job: TrainingJob) -> float | None:
    """The delta epsilon is reported at: the plan's (privacy.target_delta, else 1/(10 N) rounded
    down, filled in by the plan); None when non-private."""
    return None if job.engine is None else job.privacy.target_delta


def mechanism(job: TrainingJob) -> dict[str, Any]:
    """The ledger's summary of the mechanism (DP-SGD with its sampling, clipping, noise), read
    off the plan; the full plan is recorded beside it (`plan`)."""
    plan = job.privacy.plan
    norm = plan.clipping.max_grad_norm
    shuffled = plan.selection.kind == "shuffle"
    described: dict[str, Any] = {
        "algorithm": "DP-SGD",
        "privacy_unit": SHUFFLE_PRIVACY_UNIT if shuffled else PRIVACY_UNIT,
        "sampling": plan.selection.kind if plan.selection.kind != "given"
        else "the caller's loader (no amplification proof)",
        # amplified by (cyclic) Poisson sampling: a noise column of at most `groups` bands
        "amplified": plan.selection.amplified and plan.accounting.amplified(
            plan.selection.groups + 1),
        "clipping": plan.clipping.kind,
        "max_grad_norm": list(norm) if isinstance(norm, tuple) else norm,
        "noise": "gaussian",
        "noise_multiplier": plan.noise.multiplier,
        "sample_rate": plan.selection.sample_rate,
        "expected_batch_size": plan.expected_batch_size(job.engine.dataset_size),  # q N: N units
        "secure_mode": plan.secure,
        "randomness": job.engine.randomness(),
        "grad_sample_mode": job.privacy.performance.grad_sample_mode,
        "noise_schedule": dict(plan.noise.schedule or {}),
    }
    if privacy_unit_of(job.engine) == "user":
        described.update(user_level_mechanism(job.engine))
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
               best_checkpoint: str) -> PrivacyLedger:
    """A fresh ledger describing `job` (not yet written); `best_checkpoint` is the file
    `train.keep_best` keeps."""
    private = job.engine is not None
    validation_size = 0 if job.validation_loader is None else len(job.validation_loader.dataset)
    return PrivacyLedger.create(
        run_dir, config=job.config, dataset_name=job.dataset_name,
        dataset_size=job.dataset_size, mechanism=mechanism(job) if private else None,
        accountant=job.privacy.plan.accountant if private else None,
        plan=job.privacy.plan.to_dict() if private else None,
        target_epsilon=job.privacy.target_epsilon, delta=run_delta(job),
        validation_size=validation_size, private_preprocessing=job.private_preprocessing,
        model_selection=best_checkpoint_selection(best_checkpoint, validation_size)
        if settings.keep_best else None, synthetic=job.synthetic)

