"""Crash-safe file writes shared by the ledger, the checkpoints and the metrics log.

An atomic write puts the bytes in a temporary file of the same folder, flushes and fsyncs it,
renames it over the target (atomic on POSIX) and fsyncs the folder, so a reader sees either the
old file or the new one, never a mix, even if the process is killed at any instruction. A process
killed mid-write leaves its temporary (`.<name>.<random>.tmp`) behind: `remove_temporaries` clears
them when the folder's next run starts. A write the system refuses (disk full, quota...) raises
WriteError naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError, WriteError

TEMPORARY_SUFFIX = ".tmp"   # the atomic writes' temporaries: `.<target name>.<random>.tmp`


def _is_writer() -> bool:
    """False on the ranks other than 0 of a torch.distributed job: they write no run files."""
    from dptrain.distributed.runtime import is_main_process

    return is_main_process()


def fsync_dir(folder: Path) -> None:
    """Persist a rename in `folder` (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replace `path` by `data` atomically (temp file, flush, fsync, rename, fsync folder).

    Under torch.distributed only rank 0 writes (the other ranks return at once)."""
    if not _is_writer():
        return
    path = Path(path)
    with naming_the_file(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX,
                                   dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def atomic_write_json(path: Path | str, obj: Any) -> None:
    """Write `obj` as indented JSON atomically; non-finite floats are written as strings."""
    text = json.dumps(json_safe(obj), indent=2, sort_keys=False, default=str)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"))


def append_json_line(path: Path | str, record: dict[str, Any]) -> None:
    """Append one JSON object as a line to `path`, flushed and fsynced (rank 0 only)."""
    if not _is_writer():
        return
    with naming_the_file(path), open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(json_safe(record), default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def naming_the_file(path: Path | str) -> Iterator[None]:
    """Re-raise an OSError of the block as WriteError naming `path` (the file being written)
    and the system's reason; its `errno` is kept."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        error = WriteError(f"Could not write {str(path)!r}: {err.strerror or err}.")
        error.errno = err.errno
        raise error from err


def remove_temporaries(folder: Path | str) -> list[Path]:
    """Delete the temporaries atomic writes left in `folder` (not below it) when their process
    was killed mid-write; the files removed. Call it only where no other process writes
    (dptrain.train.run_lock holds the run folder); rank 0 only under torch.distributed."""
    if not _is_writer():
        return []
    removed = []
    for path in Path(folder).glob(f".*{TEMPORARY_SUFFIX}"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def json_safe(obj: Any) -> Any:
    """Map inf/nan to the strings "inf"/"-inf"/"nan" (strict JSON has no such numbers)."""
    if isinstance(obj, float) and math.isnan(obj):
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def ensure_writable_dir(path: Path | str, what: str = "train.run_dir") -> Path:
    """Create `path` if needed and check a file can be written in it.

    Raises ConfigError naming `what` (the config key) when the folder cannot be created or written,
    before anything is trained or overwritten.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"The output folder {str(path)!r} ({what}) cannot be written: {err.strerror or err}. "
            f"Choose a folder you can write to (for example `{what}=./outputs/run1`) or fix its "
            "permissions; nothing was trained."
        ) from err
    return path


class JsonLines:
    """A JSON-lines log (e.g. metrics.jsonl): one object per line, each append fsynced."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        append_json_line(self.path, record)

    def records(self) -> list[dict[str, Any]]:
        """Every readable line as a dict (a torn last line, from a crash, is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def keep(self, predicate: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the log atomically with only the records satisfying `predicate`."""
        if not self.path.exists():
            return
        lines = [json.dumps(r, default=str) + "\n" for r in self.records() if predicate(r)]
        atomic_write_bytes(self.path, "".join(lines).encode("utf-8"))
