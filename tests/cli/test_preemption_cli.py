"""SIGTERM and SIGUSR1 (how schedulers preempt a job) end `dptrain` like Ctrl-C, after a whole
step and a checkpoint: one line with the epsilon spent and the resume command, result.json and
the ledger say "preempted", exit status 128 + the signal's number."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dptrain_runner import ENTRY, QUIET, read_json, wait_for

from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import load_ledger
from dptrain.formatting import format_epsilon

LONG_RUN = ["train.epochs=1000", "hardware=cpu", "hydra.run.dir=run", *QUIET]  # ~0.2 s an epoch


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-c", ENTRY, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _preempt(args: list[str], cwd: Path, signals: list[int],
             ready: Path) -> tuple[subprocess.Popen, str, str]:
    """Start `dptrain ARGS`, wait until `ready` exists, send `signals`, wait for the end."""
    process = _start(args, cwd)
    wait_for(ready, process)
    for signum in signals:
        process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    return process, out, err


def _resume_command(out: str) -> list[str]:
    (line,) = [text for text in out.splitlines() if text.startswith("dptrain: preempted by")]
    return shlex.split(line.split("Resume with: ", 1)[1])


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, str]:
    """A long run preempted by one SIGTERM once training is under way, read by several tests:
    (the folder it ran in, its exit status, stdout, stderr). Tests that go on with the run copy
    the folder first."""
    cwd = tmp_path_factory.mktemp("sigterm")
    process, out, err = _preempt(LONG_RUN, cwd, [signal.SIGTERM], cwd / "run" / "checkpoints" /
                                 "last.pt")
    return cwd, process.returncode, out, err


def test_sigterm_checkpoints_the_step_reached_and_records_a_preempted_run(
        sigterm_run: tuple[Path, int, str, str]) -> None:
    cwd, returncode, out, err = sigterm_run
    run = cwd / "run"
    assert returncode == 143, err
    assert "Traceback" not in out + err
    ledger, result = load_ledger(run), read_json(run / "result.json")
    assert ledger["status"] == result["status"] == "preempted"
    assert result["error"] == "preempted (SIGTERM)"
    assert result["epsilon"] == ledger["epsilon"] > 0
    assert result["steps"] == ledger["steps_completed"]
    assert load_checkpoint(run / "checkpoints" / "last.pt")["step"] == result["steps"]
    assert f"after {result['steps']} steps; epsilon spent so far {format_epsilon(ledger['epsilon'])}" in out


def test_sigusr1_preempts_with_exit_status_138(tmp_path: Path) -> None:
    process, out, err = _preempt(LONG_RUN, tmp_path, [signal.SIGUSR1],
                                 tmp_path / "run" / "checkpoints" / "last.pt")
    assert process.returncode == 138, err
    assert read_json(tmp_path / "run" / "result.json")["status"] == "preempted"
    assert "dptrain: preempted by SIGUSR1 after" in out


def test_a_second_sigterm_stops_at_once_and_still_records_every_committed_step(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    process, out, err = _preempt(LONG_RUN, tmp_path, [signal.SIGTERM, signal.SIGTERM],
                                 run / "checkpoints" / "last.pt")
    assert process.returncode == 143, err
    assert "Traceback" not in out + err
    ledger = load_ledger(run)
    assert ledger["status"] == "preempted"
    assert ledger["steps_completed"] >= read_json(run / "result.json")["steps"]


def test_a_preempted_resumed_run_leaves_result_and_ledger_agreeing(
        sigterm_run: tuple[Path, int, str, str], tmp_path: Path) -> None:
    cwd, _, out, _ = sigterm_run
    shutil.copytree(cwd / "run", tmp_path / "run")   # resumed here; the shared run stays as it was
    run = tmp_path / "run"
    before = read_json(run / "result.json")
    first = before["steps"]
    command = _resume_command(out)
    assert command[0] == "dptrain" and command[-2:] == ["hydra.run.dir=run", "train.resume=auto"]
    epoch_after_resume = run / "checkpoints" / f"epoch_{before['epochs_completed'] + 2}.pt"
    process, out, err = _preempt(command[1:], tmp_path, [signal.SIGTERM], epoch_after_resume)
    assert process.returncode == 143, err
    assert f"resumed from run/checkpoints/last.pt at step {first}" in out
    ledger, result = load_ledger(run), read_json(run / "result.json")
    assert result["status"] == ledger["status"] == "preempted"
    assert result["steps"] == ledger["steps_completed"] > first
    assert result["epsilon"] == ledger["epsilon"]
