"""Checkpoints: atomic, integrity-checked snapshots of everything a run needs to continue exactly.

A checkpoint file (format version 2) is a fixed header followed by the payload: `MAGIC`, then
`HEADER` (the format version, the SHA-256 of the payload, the payload's length in bytes), then
the `torch.save` bytes of the state dict. The digest is checked before anything is deserialised,
so a truncated or bit-flipped file is refused with a clear error instead of silently loading wrong
weights, and the payload is read with `torch.load(weights_only=True)`: tensors and plain Python
data only, so a crafted file cannot run code when it is loaded (the digest guards against damage,
not against a forger, who can compute it). Version-1 files (a `torch.save` envelope around the
payload) are read when both parts load with `weights_only=True`, and refused otherwise. When a
file is refused as damaged, the message names the newest checkpoint beside it that still loads
(`last.pt` is a hard link to the newest epoch checkpoint: both are damaged together). Read one
with `load_checkpoint(path)` (the state: "model" is the unwrapped model's state_dict).

The state holds the model, the optimizer, the learning-rate scheduler's state (None without
one), the engine/accountant state, the RNG states (torch,
numpy, python, CUDA), every `torch.Generator` of the loader and the optimizer (the Poisson
sampler's and the noise generator only when they are reproducible, `resumable_generators`), the
step, the epoch, the config with its hash and the training data's fingerprint
(`data_fingerprint`: dptrain.data.fingerprint): tensors, numbers, strings, lists, tuples and dicts
(no other class), which `weights_only=True` reads. A checkpoint is resume state, not a file to
share: with a reproducible mechanism it holds the generators' states, from which the noise and
the batches can be rebuilt.
The model to release is written by `save_weights` (the weights alone). `Checkpointer` writes a
run's checkpoints and model files and records the checkpoints in its ledger.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import re
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.accounting.history import History, merge_history
from dptrain.train.budget import PrivacySpend
from dptrain.train.display import note, shown_path
from dptrain.train.job import Position, TrainingJob, unwrap
from dptrain.train.ledger import PrivacyLedger, describe_differences, refresh_layer_strategies, same_config
from dptrain.train.replay import start_fingerprint
from dptrain.train.settings import setting_name
from dptrain.data.fingerprint import data_fingerprint
from dptrain.distributed.fsdp import is_fully_sharded, model_state_dict, optimizer_state_dict
from dptrain.distributed.runtime import broadcast_object, is_main_process
from dptrain.errors import ConfigError
from dptrain.io import atomic_write_bytes, fsync_dir

CHECKPOINT_FORMAT = "dptrain-checkpoint"
CHECKPOINT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# A version-2 file: MAGIC, HEADER (version: uint16, SHA-256 of the payload: 32 bytes, payload
# length: uint64 bytes; big-endian), then the payload (the state's `torch.save` bytes).
MAGIC = CHECKPOINT_FORMAT.encode("ascii") + b"\n"
HEADER = struct.Struct(">H32sQ")
CHECKPOINT_DIRNAME = "checkpoints"
LAST, BEST = "last.pt", "best.pt"   # checkpoint names: the newest state, the best on validation
# The released model files (weights only, in the run folder): the final model, the best one.
MODEL_FILENAME, BEST_MODEL_FILENAME = "model.pt", "model_best.pt"
REQUIRED_KEYS = ("step", "epoch", "config", "config_hash", "model", "optimizer", "rng",
                 "generators")
EPOCH_CHECKPOINT = re.compile(r"epoch_(\d+)\.pt")   # the names train.keep_checkpoints prunes


def save_checkpoint(path: Path | str, state: dict[str, Any]) -> str | None:
    """Atomically write `state` to `path` (folder created); returns the payload's SHA-256.

    Under torch.distributed only rank 0 writes: the other ranks return None at once."""
    if not is_main_process():
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _to_bytes(state)
    digest = hashlib.sha256(payload)
    header = HEADER.pack(CHECKPOINT_VERSION, digest.digest(), len(payload))
    atomic_write_bytes(path, MAGIC + header + payload)
    return digest.hexdigest()


def link_checkpoint(source: Path | str, target: Path | str) -> None:
    """Make `target` an atomic copy of the finished checkpoint `source` (a hard link when the
    file system allows, else a byte copy), replacing any previous `target`.

    Under torch.distributed only rank 0 links (it alone wrote `source`); the others return."""
    if not is_main_process():
        return
    source, target = Path(source), Path(target)
    temporary = target.with_name(f".{target.name}.link.tmp")
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
    except OSError:
        atomic_write_bytes(target, source.read_bytes())
        return
    os.replace(temporary, target)
    fsync_dir(target.parent)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _Unreadable(ConfigError):
    """A checkpoint file that cannot be used as it is (truncated, corrupt, or holding more than
    tensors and plain data); `load_checkpoint` adds where to resume from instead."""


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    """Read and check a checkpoint without running any code a file may hold.

    Raises ConfigError naming the file when it is missing, not a dptrain checkpoint, of another
    format version, incomplete, or truncated, corrupt or unsafe; these last refusals also name
    the newest checkpoint beside it that still loads, or say that none does. No file is modified.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"No checkpoint at {str(path)!r} ({setting_name('train.resume')}): "
                          "pass an existing "
                          f"checkpoint file, or `auto` for the newest in <run_dir>/"
                          f"{CHECKPOINT_DIRNAME}.")
    try:
        return _read_checkpoint(path)
    except _Unreadable as refusal:
        raise ConfigError(f"{refusal} Nothing was overwritten. {_still_loading(path)}") from (
            refusal.__cause__)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """The state in the checkpoint file `path`: the digest checked, then the payload read with
    weights_only=True."""
    data = path.read_bytes()
    if data.startswith(MAGIC):
        payload = _payload_v2(path, data)
        origin = "dptrain never writes those: the file was made or altered elsewhere"
    else:
        payload, origin = _payload_v1(path, data), "format version 1, of an older dptrain"
    state = _read_torch(path, payload, f"holds objects other than tensors and plain data "
                        f"({origin})")
    missing = ([k for k in REQUIRED_KEYS if k not in state] if isinstance(state, dict)
               else list(REQUIRED_KEYS))
    if missing:
        raise ConfigError(f"Checkpoint {str(path)!r} lacks {missing}; it is incomplete and "
                          "cannot be resumed.")
    return state


def _payload_v2(path: Path, data: bytes) -> memoryview:
    """The payload of a version-2 file (`data` starts with MAGIC), its length and digest checked
    against the header."""
    body = memoryview(data)[len(MAGIC):]
    if len(body) < HEADER.size:
        raise _Unreadable(f"Checkpoint {str(path)!r} is truncated or corrupt (its header is "
                          f"incomplete: {len(body)} of {HEADER.size} bytes).")
    version, digest, length = HEADER.unpack_from(body)
    if version != CHECKPOINT_VERSION:
        raise _version_refusal(path, version)
    payload = body[HEADER.size:]
    if len(payload) != length:
        raise _Unreadable(f"Checkpoint {str(path)!r} is truncated or corrupt (its payload is "
                          f"{len(payload)} bytes, its header says {length}).")
    _check_digest(path, payload, digest.hex())
    return payload


def _payload_v1(path: Path, data: bytes) -> bytes:
    """The payload of a version-1 file (a `torch.save` envelope {"format", "version", "sha256",
    "payload"}), the envelope read with weights_only=True and the digest checked; ConfigError
    when `data` is another torch file."""
    envelope = _read_torch(path, data, "is not a dptrain checkpoint, or is a truncated or corrupt "
                           "one, or holds objects other than tensors and plain data")
    if not isinstance(envelope, dict) or envelope.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{str(path)!r} ({setting_name('train.resume')}) is not a dptrain "
                          "checkpoint; pass a file "
                          f"written by dptrain into <run_dir>/{CHECKPOINT_DIRNAME}.")
    if envelope.get("version") != 1:
        raise _version_refusal(path, envelope.get("version"))
    payload, digest = envelope.get("payload"), envelope.get("sha256")
    if not isinstance(payload, bytes) or not isinstance(digest, str):
        raise _Unreadable(f"Checkpoint {str(path)!r} is corrupt (its envelope lacks the payload "
                          "or its SHA-256).")
    _check_digest(path, payload, digest)
    return payload


def _check_digest(path: Path, payload: bytes | memoryview, digest: str) -> None:
    """Refuse `payload` unless its SHA-256 is `digest` (hex), before anything in it is read."""
    if hashlib.sha256(payload).hexdigest() != digest:
        raise _Unreadable(f"Checkpoint {str(path)!r} is corrupt (its SHA-256 does not match the "
                          "one written with it).")


def _version_refusal(path: Path, version: Any) -> ConfigError:
    return ConfigError(f"Checkpoint {str(path)!r} has format version {version!r}; this dptrain "
                       f"reads versions {list(READABLE_VERSIONS)}. Resume it with the dptrain "
                       "that wrote it.")


def _read_torch(path: Path, data: bytes | memoryview, problem: str) -> Any:
    """`torch.load(weights_only=True)` of `data`: tensors and plain Python data only, never code.
    Anything else, or unreadable bytes, is refused: "Checkpoint <path> <problem>: ..."."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _Unreadable(f"Checkpoint {str(path)!r} {problem}: torch.load(weights_only=True) "
                          "refuses it, and dptrain loads checkpoints in no other way, since "
                          "unpickling other objects could run code.") from err
    except Exception as err:  # torch raises many types for damaged files
        raise _Unreadable(f"Checkpoint {str(path)!r} {problem}: it cannot be read "
                          f"({type(err).__name__}).") from err


def _still_loading(path: Path) -> str:
    """Sentences naming the newest checkpoint beside the refused `path` that loads (another file
    than `path`: its hard links are damaged with it), with the `train.resume` value to resume
    from it, or saying that none does."""
    folder = path.parent
    candidates = _newest_first(folder)
    links = [c.name for c in candidates if c.name != path.name and _same_file(c, path)]
    said = (f"{', '.join(links)} {'is' if len(links) == 1 else 'are'} the same file (a hard "
            "link) and damaged with it. ") if links else ""
    for candidate in candidates:
        if _same_file(candidate, path):
            continue
        try:
            state = _read_checkpoint(candidate)
        except (ConfigError, OSError):
            continue
        shown = shown_path(candidate)
        return (f"{said}The newest checkpoint in {shown_path(folder)} that still loads is "
                f"{shown} (step {state['step']}, epoch {state['epoch']}): resume from it with "
                f"{setting_name('train.resume', shown)}.")
    return (f"{said}No other checkpoint in {shown_path(folder)} loads: start again in a new run "
            "folder.")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _newest_first(folder: Path) -> list[Path]:
    """The `*.pt` files in `folder`, the most recently written first (`last.pt` first among
    files written at the same time, e.g. hard links to one checkpoint)."""
    def written(path: Path) -> tuple[int, bool, str]:
        try:
            return path.stat().st_mtime_ns, path.name == LAST, path.name
        except OSError:
            return -1, False, path.name
    return sorted(folder.glob("*.pt"), key=written, reverse=True)


def latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The most recently written `*.pt` in `run_dir/checkpoints` (None when there is none)."""
    candidates = _newest_first(Path(run_dir) / CHECKPOINT_DIRNAME)
    return candidates[0] if candidates else None


def epoch_checkpoints_on_disk(run_dir: Path | str) -> list[str]:
    """The epoch checkpoint files (`epoch_N.pt`) in `run_dir/checkpoints`, as the ledger names
    them ("checkpoints/epoch_N.pt"), oldest written first (modification time, then N)."""
    folder = Path(run_dir) / CHECKPOINT_DIRNAME
    found = []
    for path in folder.glob("epoch_*.pt"):
        match = EPOCH_CHECKPOINT.fullmatch(path.name)
        try:
            written = path.stat().st_mtime_ns
        except OSError:   # deleted meanwhile
            continue
        if match:
            found.append((written, int(match.group(1)), f"{CHECKPOINT_DIRNAME}/{path.name}"))
    return [name for *_, name in sorted(found)]


@dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint file on disk that the ledger does not list: its process wrote it and was
    stopped (killed) before recording it. `spent` is what its state had spent: the steps charged
    from earlier processes, then its accountant's (runs of (sigma, q, steps); [] non-private)."""

    path: str      # as the ledger names it: "checkpoints/epoch_N.pt"
    step: int
    epoch: int
    spent: History


def unrecorded_checkpoints(run_dir: Path | str, recorded: Collection[str],
                           loaded: tuple[Path, dict[str, Any]] | None = None
                           ) -> list[FoundCheckpoint]:
    """The epoch checkpoints in `run_dir` that are not among `recorded` (the ledger's existing
    checkpoint paths), oldest first, each with the names `last.pt` / `best.pt` that are the same
    file (hard links written with it: the ledger's entries of those names describe an older
    state). Read-only; `loaded` is a (path, state) already read, reused for its file. A file that
    does not load is left out: it cannot be resumed, and pruning deletes it as the oldest epoch
    checkpoint (`Checkpointer.epoch_checkpoints`)."""
    run_dir = Path(run_dir)
    found: list[FoundCheckpoint] = []
    for name in epoch_checkpoints_on_disk(run_dir):
        if name in recorded:
            continue
        path = run_dir / name
        try:
            state = (loaded[1] if loaded is not None and _same_file(loaded[0], path)
                     else load_checkpoint(path))
        except (ConfigError, OSError):
            continue
        spent = merge_history(list(state.get("charged") or []) + list(state.get("history") or []))
        links = [f"{CHECKPOINT_DIRNAME}/{other}" for other in (LAST, BEST)
                 if _same_file(run_dir / CHECKPOINT_DIRNAME / other, path)]
        found += [FoundCheckpoint(each, int(state["step"]), int(state["epoch"]), spent)
                  for each in [name, *links]]
    return found


def resolve_resume(resume: str | None, run_dir: Path | str) -> Path | None:
    """The checkpoint to resume from: None, an explicit path, or "auto" (None if none yet)."""
    if resume is None or str(resume).strip() == "":
        return None
    if str(resume) == "auto":
        return latest_checkpoint(run_dir)
    return Path(resume)


def saved_split_key(path: Path | str | None) -> bytes | None:
    """The split key (`TrainingJob.split_key`) the checkpoint at `path` saved: None when there is
    no path, when the checkpoint saved none (a job without one, or a file written before the key
    existed: said in a note, the rows are then drawn anew), or when it cannot be read (the resume
    then refuses it with its own message: `load_checkpoint`)."""
    if path is None:
        return None
    try:
        state = load_checkpoint(path)
    except ConfigError:
        return None
    dataset = state.get("config", {}).get("dataset") or {}
    if "split_key" not in state and (dataset.get("validation_size") or dataset.get("max_samples")):
        note(f"Checkpoint {shown_path(path)} holds no split key (it was written by an earlier "
             "dptrain): dataset.validation_size and dataset.max_samples choose their rows anew "
             "with a fresh key, so the resumed run may train on other rows (its replayed steps "
             "are then charged again), and with a fraction as dataset.validation_size on "
             "another number of them, which the resume refuses as another privacy plan.")
    key = state.get("split_key")
    return key if isinstance(key, bytes) else None


def check_same_config(state: dict[str, Any], config: dict[str, Any], path: Path | str) -> None:
    """Raise ConfigError naming the differing keys when the checkpoint's config is another."""
    if same_config(state["config_hash"], state["config"], config):
        return
    raise ConfigError(f"Checkpoint {str(path)!r} ({setting_name('train.resume')}) was written "
                      "with a different config; differing keys: "
                      f"{describe_differences(state['config'], config)}. Resume with the same "
                      "config, or start a new run in a new folder.")


# ----------------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict[str, Any]:
    """Global RNG states: torch CPU (+ CUDA when available), numpy (as lists), python."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, keys.tolist(), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_generators(root: Any, prefix: str, depth: int = 3) -> dict[str, torch.Generator]:
    """Every `torch.Generator` reachable from `root` through attributes (not lists), by dotted
    name, e.g. {"loader.batch_sampler.generator": ...}; each generator listed once."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def walk(obj: Any, name: str, level: int) -> None:
        if isinstance(obj, torch.Generator):
            if id(obj) not in seen:
                seen.add(id(obj))
                found[name] = obj
            return
        if level == 0 or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module)):
            return
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        for key in sorted(attrs):
            walk(attrs[key], f"{name}.{key}", level - 1)

    walk(root, prefix, depth)
    return found


def resumable_generators(loader: Any, optimizer: Any) -> dict[str, torch.Generator]:
    """The generators a checkpoint saves and a resume restores: every generator of the training
    loader and of the optimizer (`find_generators`), except those seeded from OS entropy (the
    noise generator unless `optimizer.reproducible_noise`, the Poisson sampler's unless
    `reproducible`), whose states must never be written anywhere: a resume draws fresh ones."""
    found = _all_generators(loader, optimizer)
    secret = [gen for gen in _entropy_generators(loader, optimizer) if gen is not None]
    return {name: gen for name, gen in found.items() if not any(gen is s for s in secret)}


def fresh_generator_names(loader: Any, optimizer: Any) -> set[str]:
    """The names (as `find_generators` gives them) of the generators a resume leaves fresh:
    those `resumable_generators` leaves out, seeded from OS entropy."""
    return set(_all_generators(loader, optimizer)) - set(resumable_generators(loader, optimizer))


def _all_generators(loader: Any, optimizer: Any) -> dict[str, torch.Generator]:
    return {**find_generators(loader, "train_loader"), **find_generators(optimizer, "optimizer")}


def _entropy_generators(loader: Any, optimizer: Any) -> list[torch.Generator | None]:
    """The noise and sampling generators that are not reproducible (seeded from OS entropy)."""
    noise = getattr(optimizer, "noise_generator", None)
    sampler = getattr(loader, "poisson_sampler", None)
    coins = getattr(sampler, "generator", None)
    return [None if getattr(optimizer, "reproducible_noise", False) else noise,
            None if getattr(sampler, "reproducible", False) else coins]


def save_weights(path: Path | str, model: torch.nn.Module) -> None:
    """Atomically write the model file to release: `model.state_dict()` on CPU and nothing else
    (no optimizer, generator, RNG or noise state, no config); `torch.load(path,
    weights_only=True)` reads it. A model with `save_pretrained` (model=hf) is also written in
    Hugging Face's format next to it (`pretrained_folder`). Under torch.distributed only rank 0
    writes."""
    whole = model_state_dict(model)  # every rank: a collective for a fully sharded model
    if not is_main_process():
        return
    state = {name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
             for name, value in whole.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), _to_bytes(state))
    if callable(getattr(model, "save_pretrained", None)):
        _save_pretrained(pretrained_folder(path), model, state if is_fully_sharded(model) else None)


def pretrained_folder(path: Path | str) -> Path:
    """Where the model file `path` (model.pt) is also saved with `save_pretrained`: model_hf/,
    loadable with `from_pretrained` (full fine-tuning) or `PeftModel.from_pretrained` (LoRA)."""
    path = Path(path)
    return path.with_name(f"{path.stem}_hf")


def _save_pretrained(folder: Path, model: torch.nn.Module, state: dict[str, Any] | None) -> None:
    """`model.save_pretrained` (of the whole `state` of a sharded model) into a fresh folder that
    replaces `folder` once complete."""
    import shutil

    partial = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, **({} if state is None else {"state_dict": state}))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    fsync_dir(folder.parent)


def generator_states(generators: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """`get_state()` of each generator (ByteTensor), by name."""
    return {name: gen.get_state() for name, gen in generators.items()}


def restore_generators(generators: dict[str, torch.Generator],
                       states: dict[str, torch.Tensor], path: Path | str,
                       fresh: Collection[str] = ()) -> None:
    """Set each generator to its saved state; ConfigError when the sets of names differ.

    A saved state named in `fresh` (a generator this run seeds from OS entropy: a checkpoint
    written before the Poisson sampler's was holds the sampler's state) is left unused.
    """
    states = {name: state for name, state in states.items() if name not in fresh}
    if set(generators) != set(states):
        raise ConfigError(f"Checkpoint {str(path)!r} saved random generators {sorted(states)} but "
                          f"this run has {sorted(generators)}; it comes from a differently built "
                          "job and cannot be resumed exactly. Start a new run.")
    for name, gen in generators.items():
        gen.set_state(states[name])


def engine_state(engine: Any) -> dict[str, Any]:
    """The engine's state_dict when it has one, else its accountant's."""
    if hasattr(engine, "state_dict"):
        return {"engine": engine.state_dict()}
    return {"accountant": engine.accountant.state_dict()}


def load_engine_state(engine: Any, state: dict[str, Any]) -> None:
    """Inverse of `engine_state`."""
    if "engine" in state:
        engine.load_state_dict(state["engine"])
    else:
        engine.accountant.load_state_dict(state["accountant"])


class Checkpointer:
    """Writes the run's checkpoints and records them in the ledger; owns the random generators a
    checkpoint saves and a resume restores (the loader's Poisson sampler, the optimizer's noise).

    `keep` (train.keep_checkpoints): after each save only the newest `keep` epoch checkpoints
    (`epoch_N.pt`, in the order written, across resumes; files on disk the ledger does not list
    count as the oldest: `epoch_checkpoints`) stay on disk; `last.pt` and `best.pt` always do;
    None keeps every file. A deleted file stays in the ledger's record of what was
    written (`exists: false`), and the steps it held stay charged: the history is the ledger's,
    not the files'.
    """

    def __init__(self, job: TrainingJob, run_dir: Path, position: Position,
                 spend: PrivacySpend, ledger: PrivacyLedger, keep: int | None = None) -> None:
        self.job, self.run_dir, self.pos, self.spend, self.ledger = (
            job, run_dir, position, spend, ledger)
        self.keep = keep
        self.generators = resumable_generators(job.train_loader, job.optimizer)
        self.fresh_generators = fresh_generator_names(job.train_loader, job.optimizer)
        self.epoch_start_generators: dict[str, torch.Tensor] = {}
        self.last_saved_step: int | None = None
        # The training data's contents (dptrain.data.fingerprint), saved in every checkpoint: a
        # replay over other data is not the same computation (dptrain.train.replay). Read item by
        # item only when a replay can be exact (a reproducible mechanism): else it is a record.
        replays = job.engine is not None and job.engine.mechanism_replays()
        self.data_fingerprint = data_fingerprint(getattr(job.train_loader, "dataset", None),
                                                 read_items=replays)
        # A user-level run's users (which rows form each user, the cap), as its privacy unit
        # fingerprints them: None at example level and for a non-private run.
        plan = job.privacy.plan
        self.user_fingerprint = (None if plan is None
                                 else plan.unit.assignment_fingerprint(job.train_loader))

    def fingerprint(self) -> str:
        """The run's starting point (dptrain.train.replay.start_fingerprint), rank 0's on every
        rank (a fully sharded model's weights are gathered on rank 0 only)."""
        return broadcast_object(start_fingerprint(unwrap(self.job.model), self.generators))

    def mark_epoch_start(self) -> None:
        """Remember the generators' states at the start of an epoch (a mid-epoch checkpoint
        replays the epoch's batches from there)."""
        self.epoch_start_generators = generator_states(self.generators)

    def save(self, names: list[str]) -> None:
        """Save the run's state under checkpoints/<names[0]>, link the other names to it (rank 0
        only: the other ranks of a hardware=ddp run hold the same state), and record them all in
        the ledger (one write)."""
        paths = [f"{CHECKPOINT_DIRNAME}/{name}" for name in names]
        model = unwrap(self.job.model)  # every rank: collectives for a fully sharded model
        whole = (model_state_dict(model),
                 optimizer_state_dict(model, getattr(self.job.optimizer, "original_optimizer",
                                                     self.job.optimizer)))
        if is_main_process():
            self._write(paths, *whole)
        if BEST in names:
            save_weights(self.run_dir / BEST_MODEL_FILENAME, unwrap(self.job.model))
        if LAST in names:
            self.last_saved_step = self.pos.step
        refresh_layer_strategies(self.ledger, self.job.model)
        self.ledger.record_checkpoints(paths, self.pos.step, self.pos.epoch, self.spend.spent(),
                                       steps_completed=self.spend.steps_completed())
        self._prune()

    def _prune(self) -> None:
        """Delete the epoch checkpoints beyond the newest `keep` (rank 0; `epoch_checkpoints`:
        the files on disk, recorded or not) and note it in the ledger. It runs right after a
        save, so the newest state (the file just written, and last.pt) is never deleted."""
        if self.keep is None:
            return
        epochs = self.epoch_checkpoints()
        old = epochs[:max(0, len(epochs) - self.keep)]
        if not old:
            return
        if is_main_process():
            for path in old:
                (self.run_dir / path).unlink(missing_ok=True)
        self.ledger.record_deleted(old)

    def epoch_checkpoints(self) -> list[str]:
        """Every epoch checkpoint of the run, oldest first: the files on disk the ledger does not
        list (written by a process killed before it recorded them, hence older than any this
        process wrote and recorded; a resume records them, `unrecorded_checkpoints`), then the
        ledger's, in the order written (across resumes)."""
        recorded = [path for path in self.ledger.existing_checkpoints()
                    if Path(path).name not in (LAST, BEST)]
        on_disk = [path for path in epoch_checkpoints_on_disk(self.run_dir)
                   if path not in recorded]
        return on_disk + recorded

    def _write(self, paths: list[str], model_state: dict[str, Any],
               optimizer_state: dict[str, Any]) -> None:
        """The run's state written to run_dir/paths[0], the other paths linked to it (the model's
        and the optimizer's states whole: `model_state_dict`, `optimizer_state_dict`)."""
        pos = self.pos
        state = {
            "step": pos.step, "epoch": pos.epoch, "steps_in_epoch": pos.steps_in_epoch,
            "best_val_accuracy": pos.best_val_accuracy,
            "config": self.job.config, "config_hash": self.ledger.data["config_hash"],
            "model": model_state,
            "optimizer": optimizer_state,
            "lr_scheduler": (None if self.job.lr_scheduler is None
                             else self.job.lr_scheduler.state_dict()),
            "engine": engine_state(self.job.engine) if self.spend.private else None,
            **self.spend.state(),
            "rng": capture_rng_state(),
            "generators": generator_states(self.generators),
            "epoch_start_generators": self.epoch_start_generators,
            "data_fingerprint": self.data_fingerprint,
            **({} if self.user_fingerprint is None else {"user_fingerprint": self.user_fingerprint}),
            # the secret key of the validation split and the max_samples subset: a resume
            # reads it back before the data is loaded (saved_split_key)
            "split_key": self.job.split_key,
        }
        save_checkpoint(self.run_dir / paths[0], state)
        for path in paths[1:]:
            link_checkpoint(self.run_dir / paths[0], self.run_dir / path)

    def save_model(self) -> None:
        """The model to release, `model.pt`: the final weights alone (`save_weights`)."""
        save_weights(self.run_dir / MODEL_FILENAME, unwrap(self.job.model))

    def restore_generators(self, states: dict[str, torch.Tensor], path: Path | str) -> None:
        """This run's resumable generators set to `states` (`restore_generators`)."""
        restore_generators(self.generators, states, path, self.fresh_generators)

    def restore_random_state(self, state: dict[str, Any], path: Path | str) -> None:
        """Engine (accountant, sampler, noise, DP optimizer), generators and global RNGs."""
        if self.spend.private:
            load_engine_state(self.job.engine, state["engine"])
        self.restore_generators(state["generators"], path)
        restore_rng_state(state["rng"])

