"""One process per run folder, through the `dptrain` command: a folder another process holds is
refused (or waited for), and the lock dies with its holder."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dptrain_runner import ENTRY, QUIET, read_json, run_in_process

from dptrain.train.run_lock import LOCK_FILENAME

RUN = ["train.epochs=1", "hardware=cpu", "hydra.run.dir=run", *QUIET]
# A process that holds a run folder the way `dptrain` does, until its stdin closes or it is killed.
HOLDER = """import sys
from pathlib import Path
from dptrain.train.run_lock import hold_run_folder
with hold_run_folder(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run_files(folder: Path) -> dict[Path, bytes]:
    """The files a run wrote (the lock, Hydra's record of each attempt and its log left out)."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()
            and ".hydra" not in p.parts and p.name not in ("main.log", LOCK_FILENAME)}


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> Path:
    code, _, err = run_in_process(RUN, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    return tmp_path / "run"


@contextlib.contextmanager
def _held(run_dir: Path) -> Iterator[subprocess.Popen]:
    """A holder process of `run_dir`'s lock, killed when the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", "the holder could not lock the folder"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_dptrain_on_a_run_folder_another_process_holds_is_refused_naming_the_holder(
        finished_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = _run_files(finished_run)
    with _held(finished_run) as holder:
        code, _, err = run_in_process([*RUN, "train.resume=auto"], finished_run.parent,
                                      monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    message = err.splitlines()[0]
    assert f"process {holder.pid} on {socket.gethostname()}" in message
    assert str(finished_run) in message and "train.wait_for_lock=true" in message
    assert _run_files(finished_run) == before   # ledger, metrics, checkpoints, result.json


def test_a_killed_holder_releases_the_run_folder_to_a_run_waiting_for_it(
        finished_run: Path) -> None:
    with _held(finished_run) as holder:
        waiting = subprocess.Popen(
            [sys.executable, "-c", ENTRY, *RUN, "train.resume=auto", "train.wait_for_lock=true"],
            cwd=finished_run.parent, env=ENV, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        seen = []
        while not any("Waiting for" in line for line in seen):
            line = waiting.stdout.readline()
            assert line, "".join(seen)   # the run ended without waiting
            seen.append(line)
        assert f"process {holder.pid}" in seen[-1]
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    out, _ = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, "".join(seen) + out
    assert "resumed from" in out
    assert read_json(finished_run / "result.json")["status"] == "completed"


@pytest.mark.slow
def test_two_dptrain_runs_started_together_on_one_folder_train_it_once(tmp_path: Path) -> None:
    args = ["train.epochs=3", "hardware=cpu", "hydra.run.dir=run", "train.resume=auto", *QUIET]
    runs = [subprocess.Popen([sys.executable, "-c", ENTRY, *args], cwd=tmp_path, env=ENV,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    trained = [out for out, _ in outs if "from step 0" in out]   # "starts" or "restarted"
    assert len(trained) == 1, outs      # the other was refused, or resumed the finished run
    for run, (out, err) in zip(runs, outs):
        assert run.returncode == 0 or (run.returncode == 2 and "in use by" in err), err
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    assert ledger["steps_completed"] == 36 and ledger["status"] == "completed"
    # each epoch's training metrics written once (private ones: private_metrics.jsonl)
    private = (tmp_path / "run" / "private_metrics.jsonl").read_text().splitlines()
    epochs = [r["epoch"] for r in map(json.loads, private) if "train_loss" in r]
    assert epochs == [1, 2, 3]
