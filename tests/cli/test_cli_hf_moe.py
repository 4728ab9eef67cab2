"""`dptrain model=hf` on a mixture-of-experts model: a tiny saved Mixtral (tests/hf_tiny.py) trained
through the command, fully (router and fused experts private), as a causal LM and as a sequence
classifier, in ghost and hooks mode; the ledger's epsilon is the accountant's and every expert
weight moved."""

from __future__ import annotations

from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

from dptrain.accounting import compute_epsilon
from tests.hf_tiny import e2e_rows, review_rows, save_tiny_mixtral, write_csv

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

ROWS, BATCH = 24, 8
LM_DATA = ["model.task=causal_lm", "dataset=text", "dataset.train_file=e2e.csv", "dataset.test_file=e2e.csv",
           "dataset.text_column=ref", "dataset.prompt_column=mr", "dataset.label_column=null"]
CLASSIFIER_DATA = ["dataset=text", "dataset.train_file=train.csv", "dataset.test_file=train.csv",
                   "dataset.text_column=review", "dataset.label_column=label"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_moe_cli")
    save_tiny_mixtral(root / "mixtral")
    write_csv(root / "e2e.csv", e2e_rows(ROWS))
    write_csv(root / "train.csv", review_rows(ROWS))
    return root


@pytest.mark.parametrize("task, mode", [("causal_lm", "ghost"), ("causal_lm", "hooks"),
                                        ("sequence_classification", "ghost")])
def test_a_tiny_mixtral_trains_privately_through_the_command(files: Path, task: str, mode: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    run_dir = files / "runs" / f"{task}_{mode}"
    data = LM_DATA if task == "causal_lm" else CLASSIFIER_DATA
    args = ["model=hf", "model.name_or_path=./mixtral", 'model.pad_token="</s>"', *data, "dataset.max_len=16",
            f"privacy.grad_sample_mode={mode}", "train.epochs=1", f"train.batch_size={BATCH}",
            "train.max_physical_batch_size=5", f"hydra.run.dir={run_dir}"]
    code, _, err = run_in_process([*args, *QUIET], files, monkeypatch, capsys)
    assert code == 0, err
    ledger, result = read_json(run_dir / "privacy_ledger.json"), read_json(run_dir / "result.json")
    history = [(h["noise_multiplier"], h["sample_rate"], h["steps"]) for h in ledger["history"]]
    assert result["status"] == ledger["status"] == "completed"
    assert sum(steps for *_, steps in history) == ROWS // BATCH
    assert ledger["epsilon"] == pytest.approx(compute_epsilon(history, ledger["delta"], ledger["accountant"]),
                                              rel=1e-9)
    before = safetensors.load_file(str(files / "mixtral" / "model.safetensors"))
    after = safetensors.load_file(str(run_dir / "model_hf" / "model.safetensors"))
    moe = [k for k in before if ".block_sparse_moe." in k]  # saved in the per-expert checkpoint layout
    assert moe and all(not (after[k] == before[k]).all() for k in moe), moe
