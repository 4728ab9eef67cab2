"""The ledger's format: schema version, file name, statuses, the fixed notes it records, and the
JSON Schema every ledger is checked against (`schema_errors`); described in docs/ledger.md."""

from __future__ import annotations

from typing import Any

import jsonschema

# What epsilon protects (mechanism.privacy_unit) is said by the unit strategies
# (dptrain.privacy.unit); one example under add/remove, under substitution (shuffled batches) and
# under zero-out (an equal-split cyclic resume, `EQUAL_SPLIT_PARTITION_NOTE`):
from dptrain.privacy.unit import (  # noqa: F401  (re-exported: the ledger's words)
    PRIVACY_UNIT,
    SHUFFLE_PRIVACY_UNIT,
    ZERO_OUT_PRIVACY_UNIT,
)

SCHEMA_VERSION = 2
# Versions `load_ledger` reads: 1 (before the plan was recorded: Poisson sampling) and 2 (`plan`).
READABLE_VERSIONS = (1, 2)
LEDGER_FILENAME = "privacy_ledger.json"
# "interrupted": stopped by Ctrl-C (SIGINT); "preempted": stopped by SIGTERM or SIGUSR1 after a
# whole step, checkpointed (dptrain.train.preemption); "failed": stopped by an error.
STATUSES = ("running", "completed", "stopped_at_budget", "interrupted", "preempted", "failed")
# mechanism.sampling_partition of a cyclic Poisson run (dptrain.data.cyclic_sampling): why
# PRIVACY_UNIT (add/remove) holds for its groups.
CYCLIC_PARTITION_NOTE = ("each example's sampling group drawn uniformly at random, independently "
                         "of every other example's: adding or removing one example leaves the "
                         "others' groups as they are (add/remove holds)")
# ... of a run resumed from a ledger written when the groups were an equal split (no
# sampling_partition recorded), and the privacy unit that split supports.
EQUAL_SPLIT_PARTITION_NOTE = ("equal-size sampling groups (a permutation, then index mod groups), "
                              "kept from the run's first process: adding an example would "
                              "re-partition the others, so add/remove does not hold")
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
    "privacy.reproducible_mechanism=true, privacy.reproducible_noise=true in older configs, its "
    "noise) from "
    "generators seeded from train.seed; a ledger written before mechanism.randomness was recorded "
    "always did outside secure mode. For those steps: " + REPRODUCIBLE_MECHANISM_NOTE)
APPROXIMATE_ACCOUNTANTS = frozenset({"gdp"})  # CLT approximation, not an upper bound



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
                           # preprocessing that read the private training data, each sentence
                           # saying what epsilon covers of it (a vocabulary: nothing; the
                           # validation split: a row of the file); absent in ledgers written
                           # before it was recorded
                           "private_preprocessing": {"type": "array",
                                                     "items": {"type": "string"}},
                           # the SHA-256 of the training data of every process of the run
                           # (dptrain.data.fingerprint; "unknown": not hashed), in the order
                           # first used; absent in ledgers written before it was recorded
                           "fingerprints": {"type": "array", "minItems": 1, "items": {
                               "type": "string", "pattern": "^([0-9a-f]{64}|unknown)$"}},
                           # a user-level run's users (which rows form each user, the cap:
                           # dptrain.data.fingerprint.user_assignment_fingerprint) of every
                           # process, in the order first used; absent at example level and in
                           # ledgers written before it was recorded (a resume then compares a
                           # user-level ledger's users as "unknown")
                           "user_fingerprints": {"type": "array", "minItems": 1, "items": {
                               "type": "string", "pattern": "^([0-9a-f]{64}|unknown)$"}}},
        },
        "model_selection": {
            "type": ["object", "null"],
            "required": ["checkpoint", "criterion", "validation_size", "covered_by_epsilon",
                         "note"],
            # model_file, safe_to_share: absent in ledgers written before they were recorded
            "properties": {"checkpoint": {"type": "string"}, "model_file": {"type": "string"},
                           "criterion": {"type": "string"},
                           "validation_size": {"type": "integer", "minimum": 1},
                           "covered_by_epsilon": {"type": "boolean", "enum": [False]},
                           "safe_to_share": {"type": "boolean", "enum": [False]},
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
                               "exists": {"type": "boolean"},
                               # true: a file its process was killed before recording, recorded
                               # by the next resume; absent otherwise
                               "found_on_resume": {"type": "boolean"}},
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


def schema_errors(value: Any, schema: dict[str, Any] = LEDGER_SCHEMA) -> list[str]:
    """Violations of `schema` (JSON Schema 2020-12, checked by `jsonschema`), each as
    "path: message", in document order; [] when `value` is valid."""
    validator = jsonschema.Draft202012Validator(schema)
    found = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<ledger>'}: {e.message}" for e in found]
