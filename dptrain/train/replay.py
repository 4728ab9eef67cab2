"""When a resumed run may forget the steps an earlier process committed, and when it may not.

An earlier process leaves steps in the ledger beyond the point the new process resumes from (a
checkpoint, or step 0 when it wrote none): the committed-ahead block of a crash, every step run
since that checkpoint, or, when a resume goes back to an older checkpoint, steps whose results
were already written (later checkpoints, the final model, metrics.jsonl). The new process runs
those step indices again. Whether the ledger may count both versions once depends on whether the
replay is the SAME computation (`replay_is_exact`):

- a reproducible mechanism (an opt-in), resumed from a checkpoint, on the CPU: the checkpoint
  restores the model, optimizer, accountant and every generator (Poisson sampling, noise), so the
  replay draws the same batches and the same noise and computes bit for bit what the earlier
  process computed;
- a reproducible mechanism, restarted from step 0 (no checkpoint yet): the same holds only when
  the new job starts from the same state: same initial weights and generator states, which
  `start_fingerprint` checks;
- either way, only over the same training data: the same coins and the same noise drawn over a
  changed record release a second model that differs from the first by that record's influence,
  the noise cancelled (no privacy for that record: "unlearning" by replaying from a checkpoint).
  The ledger records the fingerprint of the training data of every process of the run
  (`dataset.fingerprints`, dptrain.data.fingerprint; "unknown" for a ledger written before it did,
  or a dataset whose contents cannot be hashed), and `data_difference` compares them with the
  resuming process's; a user-level run's users likewise (`dataset.user_fingerprints`: which rows
  form each user and the cap, `user_difference`), since the same coins and noise over the same
  records grouped into other users are another computation too;
- noise and sampling seeded from OS entropy (the default) or secure mode: neither is ever
  replayed (their generators' states are never saved; secure mode has none), so a replayed step
  is a new release, on a freshly drawn Poisson batch. The fresh batch is what makes charging it
  in addition correct: the same batch released again with new noise is not an independent
  subsampled step (it is one step at sigma / sqrt(2), which costs more: RDP epsilon 2.09 against
  0.98 for two independent steps at q = 0.01, sigma = 1, delta = 1e-5);
- CUDA (any device but the CPU): kernels are not bit-reproducible by default (atomics in
  reductions, algorithm choice by shape and GPU model), so a replayed step may differ from the
  released one; dptrain does not rely on deterministic algorithms and treats the replay as a new
  computation.

The ledger records the device types that computed a run's steps (`devices`, "unknown" for a
ledger written before it did), so a replay on the CPU of steps a GPU computed is not exact either.

An exact replay charges each of those steps once (`with_replayed`): they stay in the ledger from
the resume on, and the resumed run's own steps take their place as it retakes them; those it never
retakes (it stops earlier, e.g. with a smaller `train.max_steps`) stay charged. Any other replay
keeps them charged in addition to the resumed run's steps, in front of the resumed history
(privacy composition does not depend on the order of the steps). Either way the ledger never
counts fewer steps than any process committed, whatever the resume asks for; it may over-count a
few steps that were committed but never run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dptrain.accounting.history import History, history_steps, merge_history, steps_after
from dptrain.data.fingerprint import UNKNOWN
from dptrain.distributed.fsdp import model_state_dict


def start_fingerprint(model: nn.Module, generators: Mapping[str, torch.Generator]) -> str:
    """SHA-256 (hex) of a job's starting point: the model's state_dict and the states of its
    resumable generators (`checkpoint.resumable_generators`: reproducible ones only, never one
    seeded from OS entropy). Two jobs with equal fingerprints and a reproducible mechanism replay
    identically. A fully sharded model's parameters are gathered (a collective): only rank 0's
    fingerprint covers them, so under FSDP use rank 0's (`Checkpointer.fingerprint`)."""
    digest = hashlib.sha256()
    for name, value in sorted(model_state_dict(model).items()):
        digest.update(name.encode("utf-8"))
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode("utf-8"))
    for name, generator in sorted(generators.items()):
        digest.update(name.encode("utf-8"))
        digest.update(generator.get_state().numpy().tobytes())
    return digest.hexdigest()


def bitwise_reproducible(device_type: str) -> bool:
    """Whether dptrain trusts a device type ("cpu", "cuda", ...) to recompute a step bit for bit:
    the CPU only."""
    return device_type == "cpu"


def data_difference(recorded: Iterable[str], current: str) -> str | None:
    """None when every step of the run was computed on the training data the resuming process
    holds: every fingerprint `recorded` (the ledger's `dataset.fingerprints`, the checkpoint's)
    equals `current`, which is known. Otherwise why not, as a clause for the resume message."""
    return _difference(
        recorded, current,
        unknown=("the training data's contents are unknown (dataset.fingerprints: a dataset "
                 "dptrain cannot hash, or a ledger written before fingerprints were recorded), "
                 "so their replay may differ"),
        differ=("the training data differ from the data they were computed on "
                "(dataset.fingerprints), so their replay releases a different model"))


def user_difference(recorded: Iterable[str], current: str | None) -> str | None:
    """`data_difference` for the users of a user-level run: None when every step was computed
    with the users the resuming process holds (the ledger's and the checkpoint's
    `dataset.user_fingerprints` all equal `current`, `user_assignment_fingerprint`), or when the
    run is example-level (`current` None: no users). An older user-level ledger, written before
    the users were recorded, has none: it compares as "unknown", never as the same users."""
    if current is None:
        return None
    return _difference(
        recorded, current,
        unknown=("the users of the training examples are unknown (dataset.user_fingerprints: a "
                 "ledger written before they were recorded), so their replay may differ"),
        differ=("the users of the training examples (which rows form each user, "
                "max_examples_per_user) differ from those they were computed with "
                "(dataset.user_fingerprints), so their replay releases a different model"))


def _difference(recorded: Iterable[str], current: str, unknown: str, differ: str) -> str | None:
    """None when every fingerprint `recorded` equals `current` and both are known; else the
    clause `unknown` (one of them is UNKNOWN, or none was recorded) or `differ`."""
    recorded = list(recorded)
    if current == UNKNOWN or UNKNOWN in recorded or not recorded:
        return unknown
    if any(fingerprint != current for fingerprint in recorded):
        return differ
    return None


def replay_is_exact(device_types: Iterable[str], reproducible_mechanism: bool,
                    from_checkpoint: bool, same_start: bool, same_data: bool) -> bool:
    """Whether a resumed run recomputes exactly the steps an earlier process took at the same
    indices: a reproducible mechanism (noise and sampling from seeded generators, restored from
    the checkpoint; never with generators seeded from OS entropy or in secure mode,
    `PrivacyEngine.mechanism_replays`), the same starting state (a checkpoint, or a restart from
    step 0 with the same `start_fingerprint`), the same training data (`data_difference` is
    None), and every device type that computed steps of the run, the resuming one included,
    bit-reproducible (`bitwise_reproducible`; an unknown device type, "unknown", is not)."""
    return (all(bitwise_reproducible(kind) for kind in device_types) and reproducible_mechanism
            and (from_checkpoint or same_start) and same_data)


def still_charged(previous_history: History, resumed_steps: int, replays_exactly: bool) -> History:
    """The steps of the previous ledger beyond the resume point that are charged IN ADDITION to
    the resumed run's: none when the replay is exact (`with_replayed` charges those once), all of
    them otherwise.

    `resumed_steps` counts the steps of the resume point's history (charged ones included)."""
    if replays_exactly:
        return []
    return steps_after(previous_history, resumed_steps)


def with_replayed(own: History, resumed_at: int, replayed: History) -> History:
    """`own` (a resumed run's steps from step 0: `resumed_at` restored from the checkpoint, then its
    new ones) followed by the steps of `replayed` it has not retaken yet.

    `replayed` are the earlier process's steps beyond the resume point of an exact replay: the
    resumed run's step resumed_at + k is the same computation as replayed step k, so each is
    charged once, and the steps it never reaches stay charged.
    """
    retaken = history_steps(own) - int(resumed_at)
    return merge_history(list(own) + steps_after(replayed, max(0, retaken)))
