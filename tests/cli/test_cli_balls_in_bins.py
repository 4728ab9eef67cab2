"""`dptrain privacy.sampling=balls_in_bins`: a run on the embedded digits, its ledger verified,
resumed mid-epoch and at an epoch's end, and under torchrun (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dptrain_runner import QUIET, run_dptrain, run_in_process

from dptrain.accounting import random_allocation
from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import history_from_json, load_ledger, verify_ledger

BINS = ["privacy=sigma", "privacy.noise_multiplier=1.0", "privacy.sampling=balls_in_bins",
        "train.epochs=2", *QUIET]        # digits: 12 batches an epoch


def _dptrain(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process([*BINS, "hardware=cpu", *args], cwd, monkeypatch, capsys)
    assert code == 0, err


def test_a_balls_in_bins_run_is_charged_by_random_allocation_and_its_ledger_verifies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    ledger = load_ledger(tmp_path / "run")
    history = history_from_json(ledger["history"])
    assert ledger["mechanism"]["sampling"] == "balls_in_bins"
    assert ledger["mechanism"]["privacy_unit"].startswith("one training example (add/remove")
    assert history == [(1.0, 1 / 12, 24)]
    assert ledger["epsilon"] == pytest.approx(
        random_allocation.epsilon(1.0, 12, 2, ledger["delta"]), rel=1e-12)
    assert verify_ledger(tmp_path / "run").ok


def test_a_reproducible_run_resumed_mid_epoch_ends_where_an_uninterrupted_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint holds the epoch's allocation: the resumed steps draw its remaining
    batches, so the history (each epoch charged once) and the weights are the straight run's."""
    same = ["privacy.reproducible_mechanism=true"]
    _dptrain(["hydra.run.dir=straight", *same], tmp_path, monkeypatch, capsys)
    _dptrain(["hydra.run.dir=stopped", "train.max_steps=5", *same], tmp_path, monkeypatch, capsys)
    _dptrain(["hydra.run.dir=stopped", "train.resume=auto", *same], tmp_path, monkeypatch, capsys)
    straight, resumed = load_ledger(tmp_path / "straight"), load_ledger(tmp_path / "stopped")
    assert resumed["history"] == straight["history"] and resumed["epsilon"] == straight["epsilon"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "stopped" / "checkpoints" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_from_os_entropy_is_not_resumed_mid_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its allocation is never saved: the rest of the epoch would come from a new one, where an
    example already trained on in this epoch could be drawn again, charged once."""
    _dptrain(["hydra.run.dir=run", "train.max_steps=3"], tmp_path, monkeypatch, capsys)
    before = (tmp_path / "run" / "privacy_ledger.json").read_bytes()
    code, _, err = run_in_process([*BINS, "hardware=cpu", "hydra.run.dir=run",
                                   "train.resume=auto"], tmp_path,
                                  monkeypatch, capsys)
    assert code != 0 and "privacy.sampling=balls_in_bins" in err and "epoch_N.pt" in err
    assert (tmp_path / "run" / "privacy_ledger.json").read_bytes() == before


def test_a_run_from_os_entropy_resumes_at_an_epochs_end_charging_each_epoch_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run", "train.max_steps=12"], tmp_path, monkeypatch, capsys)
    _dptrain(["hydra.run.dir=run", "train.resume=auto"], tmp_path, monkeypatch, capsys)
    ledger = load_ledger(tmp_path / "run")
    assert ledger["status"] == "completed"
    assert history_from_json(ledger["history"]) == [(1.0, 1 / 12, 24)]
    assert verify_ledger(tmp_path / "run").ok


@pytest.mark.slow
def test_a_torchrun_job_draws_one_allocation_shared_by_the_ranks(tmp_path: Path) -> None:
    """Two ranks, each training on its share of every batch: the same history and epsilon as
    one process."""
    args = [*BINS, "train.max_steps=3"]
    ddp = run_dptrain(["hardware=ddp", "hardware.nproc_per_node=2", *args,
                       f"hydra.run.dir={tmp_path / 'ddp'}"], tmp_path, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    one = run_dptrain(["hardware=cpu", *args, f"hydra.run.dir={tmp_path / 'one'}"], tmp_path, timeout=300)
    assert one.returncode == 0, one.stderr
    ledgers = [json.loads((tmp_path / d / "privacy_ledger.json").read_text()) for d in ("ddp", "one")]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]


def _fsdp_and_one_process(tmp_path: Path, args: list[str]) -> list[Path]:
    """The same run under `hardware=fsdp` at 2 ranks (the command relaunches itself under
    torchrun; gloo on CPU) and on one process: their run folders."""
    folders = []
    for name, hardware in (("fsdp", ["hardware=fsdp", "hardware.nproc_per_node=2",
                                     "hardware.timeout_s=120"]), ("one", ["hardware=cpu"])):
        run = run_dptrain([*hardware, *args, f"hydra.run.dir={tmp_path / name}"], tmp_path,
                          timeout=300)
        assert run.returncode == 0, run.stderr
        folders.append(tmp_path / name)
    return folders


@pytest.mark.slow
def test_a_sharded_fsdp_job_is_charged_as_the_one_process_run(tmp_path: Path) -> None:
    """FSDP2: each rank trains on its share of the one allocation, the clipped sums are
    reduce-scattered and each rank noises its rows once: the same history and epsilon."""
    sharded, one = _fsdp_and_one_process(tmp_path, [*BINS, "train.max_steps=3"])
    ledgers = [load_ledger(folder) for folder in (sharded, one)]
    assert ledgers[0]["config"]["hardware"]["sharded"] is True
    assert history_from_json(ledgers[0]["history"]) == [(1.0, 1 / 12, 3)]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    assert verify_ledger(sharded).ok


@pytest.mark.slow
def test_a_sharded_fsdp_job_trains_on_the_one_process_runs_batches(tmp_path: Path) -> None:
    """Reproducible allocation, near-noiseless: the ranks' shares of each batch add up to the
    one-process batch, so the weights agree (to the noise and the reduction order)."""
    args = [*BINS, "train.max_steps=3", "privacy.noise_multiplier=1e-6",
            "privacy.reproducible_mechanism=true"]
    sharded, one = _fsdp_and_one_process(tmp_path, args)
    a = load_checkpoint(sharded / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(one / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4)
