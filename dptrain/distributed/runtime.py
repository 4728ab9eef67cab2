"""Where this process stands in a torch.distributed job: rank, world size, main process.

These helpers are safe to call on one process (no process group): rank 0 of a world of 1, the
main process, and collectives that return their input unchanged. The CLI's run-file writes
(`dptrain.io`), the trainer and the DP optimizer ask them instead of touching torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True inside an initialised process group with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world); 0 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of processes in `group` (default: the world); 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def is_main_process() -> bool:
    """True on global rank 0, and on a single process: the one that writes run files."""
    return get_rank() == 0


def barrier(group: Any = None) -> None:
    """Wait for every process of `group` (a no-op on one process).

    Times out after the process group's timeout (set by `setup_from_env`), so no rank hangs.
    """
    if is_distributed():
        dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank `src`'s `obj` on every process (picklable objects; `obj` itself on one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every process ([obj] on one process)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def sync_generator(generator: torch.Generator, src: int = 0, group: Any = None) -> None:
    """Give every process rank `src`'s state of `generator` (a no-op on one process).

    Used for the Poisson sampling stream, which every rank must draw identically.
    """
    if not is_distributed():
        return
    state = broadcast_object(generator.get_state(), src=src, group=group)
    generator.set_state(state)
