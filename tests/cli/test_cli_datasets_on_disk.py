"""`dptrain` reads each dataset from small files the test writes in the real on-disk format
(MNIST IDX, CIFAR-10 python pickle batches, the aclImdb folder), through each paper recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

from tests.data.datasets.on_disk import write_acl_imdb, write_cifar10, write_mnist


def _mnist(root: Path) -> int:
    write_mnist(root / "MNIST" / "raw", n_train=16, n_test=4)
    return 16


def _cifar10(root: Path) -> int:
    write_cifar10(root, per_batch=4)
    return 5 * 4


def _imdb(root: Path) -> int:
    write_acl_imdb(root)
    return 4


@pytest.mark.parametrize(
    "recipe, write, extra",
    [("mnist_cnn", _mnist, []), ("cifar10_cnn", _cifar10, []),
     ("imdb_lstm", _imdb, ["dataset.max_len=12"])],
)
def test_each_paper_recipe_trains_on_files_in_the_real_format(
        tmp_path: Path, recipe: str, write: Callable[[Path], int], extra: list[str],
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "data"
    size = write(root)
    code, _, err = run_in_process(
        [f"+recipe={recipe}", f"dataset.root={root}", "hydra.run.dir=run", "train.batch_size=2",
         "train.max_physical_batch_size=1", "train.max_steps=2", *extra, *QUIET], tmp_path,
        monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    fingerprints = ledger["dataset"].pop("fingerprints")
    assert ledger["dataset"] == {"name": recipe.split("_")[0], "size": size, "validation_size": 0,
                                 "private_preprocessing": [], "synthetic": False}
    assert len(fingerprints) == 1 and len(fingerprints[0]) == 64   # SHA-256 of the records
    assert read_json(tmp_path / "run" / "result.json")["steps"] == 2


def test_a_train_counts_vocabulary_is_warned_about_and_recorded_in_the_ledger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    _imdb(root)
    code, out, err = run_in_process(
        ["+recipe=imdb_embedding", f"dataset.root={root}", "dataset.vocabulary=train_counts",
         "dataset.max_len=12", "hydra.run.dir=run", "train.batch_size=2", "train.max_steps=1",
         *QUIET], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    (step,) = read_json(tmp_path / "run" / "privacy_ledger.json")["dataset"]["private_preprocessing"]
    assert "dataset.vocabulary=train_counts" in step and "epsilon does not cover" in step
    assert "private training data: dataset.vocabulary=train_counts" in out + err
