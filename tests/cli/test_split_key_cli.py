"""The secret split key of `dataset.validation_size` and `dataset.max_samples` through the command:
saved in the checkpoints only, read back by a resume (same rows), in no published file."""

from __future__ import annotations

from pathlib import Path

import pytest
from dptrain_runner import QUIET, run_in_process

from dptrain.data.datasets import load_dataset
from dptrain.data.fingerprint import data_fingerprint
from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import load_ledger
from tests.data.datasets.on_disk import write_mnist

RUN = ["train.epochs=2", "hardware=cpu", *QUIET, "dataset.validation_size=0.2",
       "privacy.reproducible_mechanism=true"]   # an exact replay: same noise and batches


def _dptrain(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = run_in_process([*RUN, *args], cwd, monkeypatch, capsys)
    assert code == 0, err
    return out


def test_a_resumed_run_with_a_validation_split_trains_on_the_same_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run", "train.max_steps=5"], tmp_path, monkeypatch, capsys)
    key = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["split_key"]
    _dptrain(["hydra.run.dir=run", "train.resume=auto"], tmp_path, monkeypatch, capsys)
    ledger = load_ledger(tmp_path / "run")
    assert ledger["status"] == "completed" and ledger["resumes"][-1]["charged_steps"] == 0
    # one training set for every process: the rows the saved key chose, never a new draw
    rows = load_dataset("digits", validation_size=0.2, split_key=key)
    assert ledger["dataset"]["fingerprints"] == [data_fingerprint(rows.train)]
    assert ledger["dataset"]["validation_size"] == len(rows.validation)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["split_key"] == key


def test_the_split_key_is_saved_in_the_checkpoints_and_in_no_published_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _dptrain(["hydra.run.dir=run", "train.max_steps=3", "dataset.max_samples=1000"], tmp_path,
             monkeypatch, capsys)
    run = tmp_path / "run"
    key = load_checkpoint(run / "checkpoints" / "last.pt")["split_key"]
    assert isinstance(key, bytes) and len(key) == 32
    published = [p for p in run.rglob("*") if p.is_file() and "checkpoints" not in p.parts]
    assert {p.name for p in published} >= {"privacy_ledger.json", "metrics.jsonl", "result.json",
                                           "config.yaml", "model.pt"}
    for path in published:
        data = path.read_bytes()
        assert key not in data and key.hex().encode() not in data, path
    steps = load_ledger(run)["dataset"]["private_preprocessing"]
    assert [s.split(" ")[0] for s in steps] == ["dataset.max_samples=1000",
                                                "dataset.validation_size=0.2"]


def test_a_split_key_in_the_config_is_refused_naming_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process([*RUN, "+dataset.split_key=abc"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "dataset.split_key is not a config key" in err


def test_a_resume_over_a_changed_file_with_a_validation_split_still_sees_the_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "data" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    write_mnist(images.parent, n_train=40, n_test=4)
    # a count keeps N: changed rows drawn anew cannot change q (a fraction could, and the plan
    # would then refuse the resume)
    run = ["+recipe=mnist_cnn", "dataset.root=data", "train.batch_size=8", "train.epochs=2",
           "hydra.run.dir=run", "train.keep_checkpoints=null", "dataset.validation_size=8"]
    _dptrain(run, tmp_path, monkeypatch, capsys)
    data = bytearray(images.read_bytes())
    for example in range(40):                                  # one pixel of every example
        data[16 + example * 28 * 28 + 300] ^= 0xFF
    images.write_bytes(bytes(data))
    out = _dptrain([*run, "train.resume=run/checkpoints/epoch_1.pt"], tmp_path, monkeypatch,
                   capsys)
    ledger = load_ledger(tmp_path / "run")
    assert len(set(ledger["dataset"]["fingerprints"])) == 2 and ledger["resumes"][-1][
        "charged_steps"] > 0
    assert "the training data differ from the data they were computed on" in out
