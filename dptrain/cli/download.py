"""Ranks that may download into one folder take turns: `dataset.download=true` under hardware=ddp.

Every rank of a hardware=ddp run builds its own copy of the dataset from `dataset.root`. With
`dataset.download=true`, ranks downloading into the same folder at once would overwrite each
other's half-written files. `in_turns` runs the build on global rank 0 first, then on the first
rank of every other host (a node whose `dataset.root` is not shared with rank 0 downloads its
own copy there; on a shared file system it finds rank 0's files), then on every other rank,
which finds its host's files. A failure in a turn is made known to every rank at the end of that
turn, so all ranks stop with an error and none waits for the others.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

from dptrain.distributed.runtime import all_gather_objects, get_rank, is_distributed
from dptrain.errors import ConfigError

T = TypeVar("T")
TURNS = 3  # rank 0; the first rank of each other host; everyone else


def turn_of(rank: int, hosts: list[str]) -> int:
    """0 for rank 0, 1 for the lowest rank of each other host, 2 for the rest (`hosts[r]`:
    the host name of rank r)."""
    if rank == 0:
        return 0
    return 1 if hosts.index(hosts[rank]) == rank else 2


def in_turns(build: Callable[[], T], what: str = "the dataset (dataset.download=true)") -> T:
    """`build()` on every rank, one turn after another (see the module docstring); on one
    process simply `build()`.

    Raises the rank's own error where `build` failed, and a ConfigError naming the failed ranks
    on every other rank.
    """
    if not is_distributed():
        return build()
    rank = get_rank()
    mine = turn_of(rank, all_gather_objects(socket.gethostname()))
    result: T | None = None
    for turn in range(TURNS):
        failure: Exception | None = None
        if turn == mine:
            try:
                result = build()
            except Exception as error:  # raised below, once every rank knows
                failure = error
        failed = [r for r, bad in enumerate(all_gather_objects(failure is not None)) if bad]
        if failure is not None:
            raise failure
        if failed:
            raise ConfigError(f"rank(s) {failed} could not prepare {what}; their error says why. "
                              "Nothing was trained.")
    return result  # type: ignore[return-value]  # every rank built in its turn
