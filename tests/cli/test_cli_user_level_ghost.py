"""`dptrain model=hf privacy.unit=user dataset.user_column=COLUMN` with model=hf's defaults
(privacy=finetune: ghost clipping for full fine-tuning) trains user-level DP in ghost mode, and
ghost and hooks release the same model (a tiny BERT saved by tests/hf_tiny.py, a CSV written here,
the mechanism made reproducible for the comparison). Before, the defaults met a refusal: "the norm
of a mean is not a function of the norms"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dptrain_runner import QUIET, read_json, run_in_process

from tests.hf_tiny import review_rows, save_tiny, write_csv

ROWS, USERS = 40, 20  # model=hf trains 16 users a batch by default


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user_ghost_cli")
    save_tiny(root / "bert", "bert", dropout=0.0)
    rows = [{**row, "author": f"user{(7 * i) % USERS}"} for i, row in enumerate(review_rows(ROWS))]
    write_csv(root / "train.csv", rows)
    return root


def _run(files: Path, name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
         *extra: str) -> Path:
    run_dir = files / "runs" / name
    args = [*QUIET, "model=hf", "model.name_or_path=./bert", "dataset=text",
            "dataset.train_file=train.csv", "dataset.text_column=review", "privacy.unit=user",
            "dataset.user_column=author", f"hydra.run.dir={run_dir}", *extra]
    code, _, err = run_in_process(args, files, monkeypatch, capsys)
    assert code == 0, err
    return run_dir


def test_user_level_with_model_hf_defaults_runs_in_ghost_mode(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    ledger = read_json(_run(files, "defaults", monkeypatch, capsys) / "privacy_ledger.json")
    assert ledger["status"] == "completed"
    assert ledger["mechanism"]["grad_sample_mode"] == "ghost"
    assert ledger["mechanism"]["num_users"] == USERS


def test_ghost_and_hooks_user_level_runs_release_the_same_model(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    same = ("privacy.reproducible_mechanism=true", "train.seed=3", "train.max_steps=4",
            "train.batch_size=3", "train.max_physical_batch_size=2")  # users cut between chunks
    ghost = _run(files, "ghost", monkeypatch, capsys, *same)
    hooks = _run(files, "hooks", monkeypatch, capsys, *same, "privacy.grad_sample_mode=hooks")
    assert read_json(ghost / "privacy_ledger.json")["mechanism"]["grad_sample_mode"] == "ghost"
    released = [torch.load(run / "model.pt", weights_only=True) for run in (ghost, hooks)]
    assert released[0].keys() == released[1].keys()
    for key in released[0]:
        torch.testing.assert_close(released[0][key], released[1][key], rtol=1e-6, atol=1e-8, msg=key)  # measured: 2.3e-10
    history = [read_json(run / "privacy_ledger.json")["history"] for run in (ghost, hooks)]
    assert history[0] == history[1]
