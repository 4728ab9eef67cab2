"""`dptrain-ledger` on runs whose ledger charges steps not known to have finished: a job of a
sweep SIGKILLed after its first block of steps was committed shows the steps its ledger charges
(those its epsilon counts), and the check says why they exceed the steps that finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.cli.sweep_ledger import write_sweep_ledger
from dptrain.train.ledger import load_ledger
from dptrain.train.loop import train
from tests.train.test_trainer_support import make_job, make_settings

STEPS_PER_EPOCH = 4   # tests/train/test_trainer_support: 48 examples, batches of 12
ROOT = Path(__file__).resolve().parents[2]

_KILLED_AT_SECOND_STEP = """
import os, signal, sys
from pathlib import Path
import torch
from tests.train.test_trainer_support import make_job, make_settings
from dptrain.train.loop import train

calls = []
def loss(out, y):
    if torch.is_grad_enabled():
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return torch.nn.functional.cross_entropy(out, y)
train(make_job(loss_fn=loss), make_settings(Path(sys.argv[1]), epochs=3))
"""


def _job_folder(sweep: Path, name: str) -> Path:
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create([f"train.seed={name}"]), folder / ".hydra" / "overrides.yaml")
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder: job 0 trained 3 epochs; job 1 SIGKILLed in its second step, after its
    first block (one epoch, 4 steps) was committed, so its ledger says "running", 0 steps
    finished, 4 committed ahead."""
    sweep = tmp_path_factory.mktemp("sweep")
    train(make_job(), make_settings(_job_folder(sweep, "0"), epochs=3))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_SECOND_STEP,
                             str(_job_folder(sweep, "1"))], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    write_sweep_ledger(sweep)
    return sweep


def test_the_killed_job_is_running_with_its_first_block_committed(sweep: Path) -> None:
    ledger = load_ledger(sweep / "1")
    assert ledger["status"] == "running"
    assert (ledger["steps_completed"], ledger["committed_ahead"]) == (0, STEPS_PER_EPOCH)


def test_the_verifiers_sweep_table_shows_the_steps_each_ledger_charges(
        sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert ledger_main([str(sweep)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip()[:1] in ("0", "1") and "│" in line}
    assert rows["0"][:5] == ["0", "│", "completed", "│", str(3 * STEPS_PER_EPOCH)]
    assert rows["1"][:5] == ["1", "│", "running", "│", str(STEPS_PER_EPOCH)]


def test_the_verifier_says_why_a_killed_job_charges_steps_that_never_finished(
        sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    why = ("4 steps charged beyond the 0 that finished: committed to the ledger before their "
           "batches were drawn (a step is charged before it touches the data) by a process that "
           "is still running, or was killed before it could record how far it got")
    capsys.readouterr()
    assert ledger_main([str(sweep), "--json"]) == 0
    results = {Path(r["path"]).parent.name: r
               for r in json.loads(capsys.readouterr().out) if "kind" not in r}
    assert results["0"]["message"] == results["1"]["message"] == "matches"
    assert results["0"]["note"] is None and results["1"]["note"] == why
    assert ledger_main([str(sweep)]) == 0
    assert f"* 1: {why}." in " ".join(capsys.readouterr().out.split())
