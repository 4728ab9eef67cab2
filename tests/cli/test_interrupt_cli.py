"""Ctrl-C stops `dptrain` like a normal ending: one line with the epsilon spent so far and the
command that resumes the run, the ledger and result.json say "interrupted", no traceback."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from dptrain_runner import ENTRY, QUIET, read_json, run_in_process, wait_for

from dptrain.train.ledger import load_ledger
from dptrain.formatting import format_epsilon

LONG_RUN = ["train.epochs=1000", "hardware=cpu", "hydra.run.dir=run", *QUIET]  # ~0.2 s an epoch


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """`dptrain ARGS` in a subprocess that Ctrl-C (SIGINT) reaches, even when this test runs
    where SIGINT is ignored (a background job)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-c", ENTRY, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_ends_the_run_with_one_line_an_interrupted_ledger_and_a_command_that_resumes(
        tmp_path: Path, monkeypatch, capsys) -> None:
    process = _start(LONG_RUN, tmp_path)
    wait_for(tmp_path / "run" / "checkpoints" / "last.pt", process)   # training is under way
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    (line,) = [text for text in out.splitlines() if text.startswith("dptrain: interrupted")]
    ledger, result = load_ledger(tmp_path / "run"), read_json(tmp_path / "run" / "result.json")
    assert ledger["status"] == result["status"] == "interrupted"
    assert result["epsilon"] == ledger["epsilon"] > 0 and result["steps"] >= 12
    assert f"epsilon spent so far {format_epsilon(ledger['epsilon'])} at delta 1e-05" in line
    command = shlex.split(line.split("Resume with: ", 1)[1])
    assert command[0] == "dptrain" and command[-2:] == ["hydra.run.dir=run", "train.resume=auto"]
    code, resumed_out, resumed_err = run_in_process(
        [*command[1:], f"train.max_steps={result['steps'] + 1}"], tmp_path, monkeypatch, capsys)
    assert code == 0, resumed_err
    assert "resumed from run/checkpoints/last.pt at step " in resumed_out
    assert load_ledger(tmp_path / "run")["resumes"][-1]["checkpoint"].endswith("last.pt")


def test_ctrl_c_before_training_says_no_step_was_taken_without_a_traceback(
        tmp_path: Path, monkeypatch, capsys) -> None:
    import dptrain.cli.build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt   # Ctrl-C while the data loads

    monkeypatch.setattr(dptrain.cli.build, "build_job", interrupted)
    code, out, err = run_in_process(["hydra.run.dir=run", *QUIET], tmp_path, monkeypatch, capsys)
    assert code == 130 and "Traceback" not in out + err
    assert "dptrain: interrupted before training started: no step was taken." in out
    assert read_json(tmp_path / "run" / "result.json")["status"] == "interrupted"
    assert not (tmp_path / "run" / "privacy_ledger.json").exists()
