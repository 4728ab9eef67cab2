"""The `dptrain hardware=ddp` command itself: re-launch through torchrun, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ENTRY = "from dptrain.cli.main import main; main()"
COMMON = ["privacy=sigma", "privacy.noise_multiplier=1.0", "train.epochs=1", "train.max_steps=2",
          "train.progress=false"]


def _run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _dptrain(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", ENTRY, *args], cwd, timeout)


def test_several_nodes_without_torchrun_stop_with_the_multi_node_recipe(tmp_path: Path, monkeypatch, capsys):
    from dptrain.cli.main import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dptrain", "hardware=ddp", "hardware.nodes=2", *COMMON,
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    assert "hardware.nodes=2" in capsys.readouterr().err


@pytest.mark.slow
def test_dptrain_relaunches_itself_under_torchrun_and_matches_the_single_process_ledger(tmp_path: Path):
    ddp = _dptrain(["hardware=ddp", "hardware.nproc_per_node=2", *COMMON,
                    f"hydra.run.dir={tmp_path / 'ddp'}"], tmp_path, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    single = _dptrain(["hardware=cpu", *COMMON, f"hydra.run.dir={tmp_path / 'cpu'}"], tmp_path,
                      timeout=300)
    assert single.returncode == 0, single.stderr
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text()) for d in ("ddp", "cpu")]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    assert json.loads((tmp_path / "ddp" / "result.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_a_user_launched_torchrun_job_matches_the_single_process_ledger(tmp_path: Path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "dptrain.cli.main"]
    ddp = _run([*torchrun, "hardware=ddp", *COMMON, f"hydra.run.dir={tmp_path / 'ddp'}"],
               tmp_path, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    single = _dptrain(["hardware=cpu", *COMMON, f"hydra.run.dir={tmp_path / 'cpu'}"], tmp_path,
                      timeout=300)
    assert single.returncode == 0, single.stderr
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text())
               for d in ("ddp", "cpu")]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    assert ddp.stdout.count("dptrain: completed") == 1  # rank 0's summary only


@pytest.mark.slow
def test_a_shuffled_ddp_job_trains_on_the_one_process_runs_batches(tmp_path: Path):
    """privacy.sampling=shuffle under torchrun: every rank draws rank 0's permutation and keeps
    its share of each batch, so the history and epsilon are the one process's and, reproducible
    and near-noiseless, the weights too (to the reduction order); the ledgers verify."""
    from dptrain.train.checkpoint import load_checkpoint
    from dptrain.train.ledger import verify_ledger

    args = [*COMMON, "privacy.sampling=shuffle", "train.max_steps=4",
            "privacy.noise_multiplier=1e-6", "privacy.reproducible_mechanism=true"]
    for name, hardware in (("ddp", ["hardware=ddp", "hardware.nproc_per_node=2"]),
                           ("cpu", ["hardware=cpu"])):
        run = _dptrain([*hardware, *args, f"hydra.run.dir={tmp_path / name}"], tmp_path, 300)
        assert run.returncode == 0, run.stderr
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text()) for d in ("ddp", "cpu")]
    assert ledgers[0]["mechanism"]["sampling"] == "shuffle"
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    assert all(verify_ledger(tmp_path / d).ok for d in ("ddp", "cpu"))
    a = load_checkpoint(tmp_path / "ddp" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "cpu" / "checkpoints" / "last.pt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["shuffle", "balls_in_bins"])
def test_an_epoch_bound_ddp_job_resumed_mid_epoch_ends_where_the_straight_job_ends(
        tmp_path: Path, sampling: str):
    """Resume x epoch-bound selection x DDP: each rank's checkpointed sampler holds the epoch's
    permutation or allocation (reproducible), so the resumed ranks train on the rest of the same
    epoch: the history, epsilon and weights are the uninterrupted 2-rank job's."""
    from dptrain.train.checkpoint import load_checkpoint

    ddp = ["hardware=ddp", "hardware.nproc_per_node=2", *COMMON, f"privacy.sampling={sampling}",
           "train.max_steps=null", "privacy.reproducible_mechanism=true"]
    runs = [("straight", []), ("stopped", ["train.max_steps=5"]),
            ("stopped", ["train.resume=auto"])]
    for folder, extra in runs:
        run = _dptrain([*ddp, *extra, f"hydra.run.dir={tmp_path / folder}"], tmp_path, 300)
        assert run.returncode == 0, run.stderr
    straight, resumed = (json.loads((tmp_path / d / "privacy_ledger.json").read_text())
                         for d in ("straight", "stopped"))
    assert resumed["history"] == straight["history"] and resumed["epsilon"] == straight["epsilon"]
    assert len(resumed["resumes"]) == 1
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "stopped" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
