"""Run the real `dptrain` command in a subprocess (shared by the CLI tests)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# What the `dptrain` console script runs, with this test's interpreter (no PATH lookup).
ENTRY = "from dptrain.cli.main import main; main()"
QUIET = ["train.progress=false"]


def run_dptrain(
    args: list[str], cwd: Path, timeout: float = 120, verbose_env: bool = False
) -> subprocess.CompletedProcess:
    """`dptrain ARGS` run from `cwd`; HYDRA_FULL_ERROR only when `verbose_env`."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["OMP_NUM_THREADS"] = "1"
    if verbose_env:
        env["HYDRA_FULL_ERROR"] = "1"
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_json(path: Path) -> Any:
    """The JSON document in `path`."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def run_in_process(
    args: list[str], cwd: Path, monkeypatch: Any, capsys: Any
) -> tuple[int, str, str]:
    """The real `dptrain` entry point called in this process (fast: no interpreter start-up).

    Returns (exit status, stdout, stderr); HYDRA_FULL_ERROR is unset for the call and restored.
    """
    from dptrain.cli.main import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")
    monkeypatch.setattr(sys, "argv", ["dptrain", *args])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


class _StringCapture:
    """What `run_in_process` needs of capsys, over this process's redirected stdout and stderr."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self) -> tuple[str, str]:
        """The text written since the last call (stdout, stderr)."""
        taken = self.out.getvalue(), self.err.getvalue()
        for stream in (self.out, self.err):
            stream.seek(0)
            stream.truncate()
        return taken


def run_once_in_process(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """`run_in_process` for a module- or session-scoped fixture (no monkeypatch or capsys there).

    One run shared by several tests that each check one property of it. Returns (exit status,
    stdout, stderr); the working directory, argv and environment are restored afterwards.
    """
    capture = _StringCapture()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(capture.out), \
            contextlib.redirect_stderr(capture.err):
        return run_in_process(args, cwd, patch, capture)


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until `path` exists while `process` runs (its output in the failure when it ended)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
