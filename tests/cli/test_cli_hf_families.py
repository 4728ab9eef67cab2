"""`dptrain model=hf` on the Gemma family, through the real command, offline.

Tiny random-init Gemma 2 and Gemma 3 (text) models, causal LM and sequence classifier, saved with
save_pretrained (tests/hf_tiny.py:save_tiny_gemma) and trained on CSV files written here with the
defaults `model=hf` brings (privacy=finetune: ghost clipping for full fine-tuning, hooks with
LoRA). Full fine-tuning of Gemma was refused before its scaled word embedding had rules: the
per-sample gradients of `embed_tokens.weight` did not add up to its gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dptrain_runner import QUIET, read_json, run_in_process

from tests.hf_tiny import GEMMA_FAMILIES, e2e_rows, review_rows, save_tiny_gemma, write_csv

ROWS, BATCH = 24, 8
TASKS = ("causal_lm", "sequence_classification")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_families")
    for family in GEMMA_FAMILIES:
        for task in TASKS:
            save_tiny_gemma(root / f"{family}_{task}", family, task)
    write_csv(root / "reviews.csv", review_rows(ROWS))
    write_csv(root / "e2e.csv", e2e_rows(ROWS))
    return root


def _data_args(task: str) -> list[str]:
    if task == "causal_lm":
        return ["model.task=causal_lm", "dataset=text", "dataset.train_file=e2e.csv",
                "dataset.text_column=ref", "dataset.prompt_column=mr", "dataset.label_column=null"]
    return ["dataset=text", "dataset.train_file=reviews.csv", "dataset.text_column=review",
            "dataset.label_column=label"]


def _train(files: Path, name: str, task: str, run: str, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture, *extra: str) -> Path:
    run_dir = files / "runs" / run
    args = [*QUIET, "model=hf", f"model.name_or_path=./{name}", 'model.pad_token="</s>"',
            *_data_args(task), "dataset.max_len=16", "train.epochs=1", f"train.batch_size={BATCH}",
            "train.max_physical_batch_size=4", f"hydra.run.dir={run_dir}", *extra]
    code, _, err = run_in_process(args, files, monkeypatch, capsys)
    assert code == 0, err
    return run_dir


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_a_tiny_gemma_fine_tunes_fully_in_ghost_mode_through_the_command(
        files: Path, family: str, task: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    name = f"{family}_{task}"
    run_dir = _train(files, name, task, name, monkeypatch, capsys)
    ledger = read_json(run_dir / "privacy_ledger.json")
    assert ledger["status"] == "completed" and ledger["mechanism"]["grad_sample_mode"] == "ghost"
    assert sum(h["steps"] for h in ledger["history"]) == ROWS // BATCH
    released = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in released.values() if v.is_floating_point())


def test_a_tiny_gemma_fine_tunes_with_lora_through_the_command(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = _train(files, "gemma3_causal_lm", "causal_lm", "gemma3_lora", monkeypatch, capsys,
                     "model.lora={r:2,alpha:4,target_modules:[q_proj,v_proj]}")
    ledger = read_json(run_dir / "privacy_ledger.json")
    assert ledger["status"] == "completed" and ledger["mechanism"]["grad_sample_mode"] == "hooks"


@pytest.mark.parametrize("family, task", [("gemma2", "sequence_classification"), ("gemma3", "causal_lm")])
def test_a_tiny_gemma_fine_tunes_fully_in_hooks_mode_through_the_command(
        files: Path, family: str, task: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    # hooks mode audits the per-sample gradients' sum: Gemma's scaled embedding failed it before
    name = f"{family}_{task}"
    run_dir = _train(files, name, task, f"{name}_hooks", monkeypatch, capsys,
                     "privacy.grad_sample_mode=hooks", "model.freeze_embeddings=false")
    ledger = read_json(run_dir / "privacy_ledger.json")
    assert ledger["status"] == "completed" and ledger["mechanism"]["grad_sample_mode"] == "hooks"
