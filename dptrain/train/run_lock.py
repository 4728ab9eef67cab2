"""One process per run folder: an exclusive lock held from before the folder is read to the end.

Two processes training into one folder (two `train.resume=auto` started together) would each
resume from the same checkpoint, train the same steps and write their ledgers over each other:
the ledger would count one run's steps while both were taken. `hold_run_folder` takes an
exclusive `fcntl.flock` on `<run folder>/.dptrain.lock` before anything there is read for a
resume, and keeps it until the run ends, however it ends; the operating system releases it when
the holder dies (a SIGKILL, a crash), so a dead run never blocks its resume. The holder writes its
pid, host and start time into the file, which a refused process names. Under torch.distributed
only rank 0 takes it, and every rank learns the outcome (one broadcast, so a wait is bounded by
the process group's timeout): every rank stops or none does. On a platform without `fcntl`
(Windows) no lock is taken; on a file system that cannot lock, a note says the run goes on
without it.

Once held, the folder has no other writer: the temporaries a killed process left mid-write
(dptrain.io) are deleted there.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from dptrain.distributed.runtime import broadcast_object, is_main_process
from dptrain.errors import RunFolderBusyError
from dptrain.io import remove_temporaries
from dptrain.train.checkpoint import CHECKPOINT_DIRNAME
from dptrain.train.display import note
from dptrain.train.settings import setting_name

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

LOCK_FILENAME = ".dptrain.lock"


@contextlib.contextmanager
def hold_run_folder(run_dir: Path, wait: bool = False) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block; clear the temporaries of killed writers first.

    Raises RunFolderBusyError (a ConfigError) naming the holder when another process holds it,
    unless `wait` (`train.wait_for_lock`): then wait until it is released. Under
    torch.distributed every rank calls it; rank 0 locks, the others raise if rank 0 could not.
    """
    with contextlib.ExitStack() as stack:
        refusal = None
        if is_main_process():
            try:
                stack.enter_context(_flock(Path(run_dir), wait))
            except RunFolderBusyError as error:
                refusal = str(error)
        refusal = broadcast_object(refusal)
        if refusal is not None:
            raise RunFolderBusyError(refusal)
        for folder in (Path(run_dir), Path(run_dir) / CHECKPOINT_DIRNAME):
            remove_temporaries(folder)
        yield


@contextlib.contextmanager
def _flock(run_dir: Path, wait: bool) -> Iterator[None]:
    """The exclusive lock on `run_dir/.dptrain.lock` for the block, the holder written in it."""
    if fcntl is None:
        yield
        return
    fd = os.open(run_dir / LOCK_FILENAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _acquire(fd, run_dir, wait):
            yield
            return
        with contextlib.suppress(OSError):   # the holder's details are a courtesy
            _write_holder(fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):   # still held: no reader sees a released holder
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)              # releases the lock


def _acquire(fd: int, run_dir: Path, wait: bool) -> bool:
    """Lock `fd` (waiting for the holder when `wait`); False where the file system cannot lock
    (some network mounts: said in a note). RunFolderBusyError when held and not `wait`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError as err:
        note(f"The run folder {str(run_dir)!r} cannot be locked ({err.strerror or err}): "
             "nothing stops another dptrain run from using it at the same time.")
        return False
    holder = _holder(fd)
    if not wait:
        raise RunFolderBusyError(_busy_message(run_dir, holder))
    note(f"Waiting for {holder} to release the run folder {str(run_dir)!r} "
         f"({setting_name('train.wait_for_lock', True)}).")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return True


def _write_holder(fd: int) -> None:
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    data = (json.dumps(record) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _holder(fd: int) -> str:
    """"process <pid> on <host>, running since <time>", as the holder wrote it (or less)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return (f"process {record['pid']} on {record['host']}, running since "
                f"{record['started']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"


def _busy_message(run_dir: Path, holder: str) -> str:
    return (f"The run folder {str(run_dir)!r} ({setting_name('hydra.run.dir')}) is in use by "
            "another dptrain "
            f"run: {holder} holds its lock {LOCK_FILENAME!r}. Two runs in one folder would "
            "train the same steps and write their checkpoints, metrics and privacy ledger over "
            "each other. Wait until that run ends (or stop it) and run this command again, add "
            f"`{setting_name('train.wait_for_lock', True)}` to wait for it, or give this run its own folder. "
            "Nothing was changed.")
