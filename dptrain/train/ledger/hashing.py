"""The config hash: what a run's config must keep for a resume to be the same run (config
keys exempt from it, keys renamed or added since a ledger was written)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dptrain.distributed.consistency import flatten
from dptrain.io import json_safe

# Config keys left out of the config hash: they may change between a run and its resume without
# changing what is trained. The set is part of the ledger format (verification recomputes the
# recorded hash from the recorded config): adding a key here would break every older ledger.
HASH_EXEMPT_KEYS = ("train.resume", "train.progress", "train.max_steps", "train.run_dir",
                    "train.keep_checkpoints", "train.wait_for_lock", "hydra", "logger")
# Where and on how many processes a run computes: a checkpoint holds whole states (the model and
# optimizer gathered under FSDP), so a run may resume on another device or number of ranks
# (hardware=cpu, ddp, fsdp). They are hashed, but a resume does not compare them.
# hardware.precision is not among them: it changes what is computed.
PROCESS_LAYOUT_KEYS = ("hardware.device", "hardware.num_workers", "hardware.distributed",
                       "hardware.sharded", "hardware.fsdp_units", "hardware.nproc_per_node",
                       "hardware.nodes", "hardware.backend", "hardware.timeout_s")
# Every key a resume may change.
RESUME_EXEMPT_KEYS = (*HASH_EXEMPT_KEYS, *PROCESS_LAYOUT_KEYS)
# Config keys renamed since a ledger or checkpoint was written: {old name: new name}. A resume
# compares the recorded values under their new names. privacy.reproducible_noise=true seeded the
# noise and the sampling from train.seed, as reproducible_mechanism=true does; =false seeded the
# sampling alone (now from OS entropy too: the resumed steps are not less private, and
# `carry_randomness` keeps the ledger's flag).
# The privacy group's keys before it mirrored the plan's parts (flat) -> their nested names; the
# command still reads them as aliases (dptrain.cli.privacy_config), a recorded flat config is
# compared under the nested names. A part given as one word (`privacy.noise=banded`, a flat
# config's `privacy.noise: banded`) is its kind. privacy.poisson_sampling is read by its value:
# false means privacy.sampling.kind=shuffle, true says nothing (POISSON_SAMPLING).
FLAT_PRIVACY_KEYS = {
    "privacy.noise_multiplier": "privacy.budget.sigma",
    "privacy.target_epsilon": "privacy.budget.target_epsilon",
    "privacy.target_delta": "privacy.budget.delta",
    "privacy.sampling": "privacy.sampling.kind",
    "privacy.sampling_groups": "privacy.sampling.groups",
    "privacy.noise": "privacy.noise.kind",
    "privacy.noise_bands": "privacy.noise.bands",
    "privacy.noise_buffers": "privacy.noise.buffers",
    "privacy.unit": "privacy.unit.kind",
    "privacy.max_examples_per_user": "privacy.unit.max_examples_per_user",
}
POISSON_SAMPLING = ("privacy.poisson_sampling", "privacy.sampling.kind", "shuffle")
RENAMED_KEYS = {"privacy.reproducible_noise": "privacy.reproducible_mechanism",
                **FLAT_PRIVACY_KEYS}
# Config keys added since a ledger or checkpoint was written: {key: the value every earlier run
# had, which means what the older config did}. A key at that value is hashed as absent, so those
# runs still resume. privacy.sampling null defers to privacy.poisson_sampling, as before; the
# privacy unit was one example, no dataset named users; the learning rate was constant; the
# noise was independent; a new classifier head started random (an older full fine-tuning run
# resumes with model.zero_init_head=false, the value it trained with); every parameter trained
# at optimizer.lr (a new head's own rate, optimizer.head_lr, null); a classifier read the
# transformers class's own head (model.pooling=model; `auto` reads a sentence-transformers
# checkpoint's pooling: another model, so such a run resumes only with model.pooling=model); the
# base was never quantized (model.quantize null). The nested privacy keys are added at the meaning
# of their flat names' defaults, so a flat config and its nested form compare alike.
ADDED_KEYS: dict[str, Any] = {"privacy.sampling": None, "privacy.sampling_groups": None,
                              "privacy.unit": "example",
                              "privacy.max_examples_per_user": None, "dataset.user_column": None,
                              "lr_schedule.kind": "constant", "privacy.noise": "independent",
                              "privacy.noise_bands": None, "privacy.noise_buffers": None,
                              "model.zero_init_head": False, "optimizer.head_lr": None,
                              "model.pooling": "model", "model.quantize": None,
                              **{FLAT_PRIVACY_KEYS[key]: value for key, value in (
                                  ("privacy.sampling", None), ("privacy.sampling_groups", None),
                                  ("privacy.unit", "example"),
                                  ("privacy.max_examples_per_user", None),
                                  ("privacy.noise", "independent"), ("privacy.noise_bands", None),
                                  ("privacy.noise_buffers", None))},
                              # a sigma run had no target epsilon (no cap), an epsilon run no
                              # sigma; a delta not given is the 1/(10 N) rule
                              "privacy.budget.target_epsilon": None,
                              "privacy.budget.sigma": None, "privacy.budget.delta": None}


def _kept_items(items: dict[str, Any], exempt_keys: tuple[str, ...]) -> dict[str, Any]:
    """The flattened config `items` without `exempt_keys` (and the keys under them) and without
    the ADDED_KEYS at the value earlier runs had."""
    def exempt(key: str, value: Any) -> bool:
        return (any(key == k or key.startswith(k + ".") for k in exempt_keys)
                or (key in ADDED_KEYS and ADDED_KEYS[key] == value))

    return {k: v for k, v in items.items() if not exempt(k, v)}


def config_hash(config: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of the config, HASH_EXEMPT_KEYS left out."""
    canonical = json.dumps(json_safe(_kept_items(flatten(config), HASH_EXEMPT_KEYS)),
                           sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def renamed(items: dict[str, Any]) -> dict[str, Any]:
    """Flattened config `items` under today's names: RENAMED_KEYS renamed, and
    privacy.poisson_sampling read by its value (POISSON_SAMPLING: false is a shuffle)."""
    out = {RENAMED_KEYS.get(k, k): v for k, v in items.items()}
    alias, key, shuffle = POISSON_SAMPLING
    if out.pop(alias, None) is False:
        out[key] = shuffle
    return out


def _compared(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flattened values a resume compares, both configs under today's names (`renamed`: a
    flat privacy group as its nested form): RESUME_EXEMPT_KEYS left out, and the old config's
    missing ADDED_KEYS at their old meaning."""
    a = json_safe(_kept_items(renamed(flatten(old)), RESUME_EXEMPT_KEYS))
    b = json_safe(_kept_items(renamed(flatten(new)), RESUME_EXEMPT_KEYS))
    a.update({k: v for k, v in ADDED_KEYS.items() if k not in a and k in b})
    return a, b


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys of two `_compared` value maps whose values differ (or exist on one side), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k, "<missing>") != b.get(k, "<missing>"))


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two configs (as `_compared` reads them), sorted."""
    return _differing(*_compared(old, new))


def describe_differences(old: dict[str, Any], new: dict[str, Any], limit: int = 10) -> str:
    """The first `limit` differing keys with both values, for a refusal to resume, e.g.
    "model.pooling (recorded 'model', now 'auto')"; "(hash only)" when only the hash differs."""
    a, b = _compared(old, new)
    keys = _differing(a, b)
    shown = [f"{k} (recorded {a.get(k, '<missing>')!r}, now {b.get(k, '<missing>')!r})"
             for k in keys[:limit]]
    return ", ".join(shown) + (" ..." if len(keys) > limit else "") or "(hash only)"


def same_config(recorded_hash: str, recorded: dict[str, Any], config: dict[str, Any]) -> bool:
    """True when `config` is the recorded run's config: the same hash, or the same values (a
    typed config reads `optimizer.lr=1` as 1.0 where an untyped one kept 1: same run)."""
    return recorded_hash == config_hash(config) or not config_differences(recorded, config)
