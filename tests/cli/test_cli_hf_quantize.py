"""`dptrain model=hf model.lora=... model.quantize=int8|nf4`: LoRA over a quantized base (QLoRA)
trained through the real command, offline, on a tiny Llama classifier saved with save_pretrained
(tests/hf_tiny.py); the refusal of a quantized base without LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dptrain_runner import QUIET, read_json, run_in_process

from dptrain.accounting import compute_epsilon
from dptrain.train.ledger import config_differences, config_hash
from tests.hf_tiny import review_rows, save_tiny, write_csv

pytest.importorskip("bitsandbytes")

TRAIN_ROWS, BATCH = 48, 12
LORA = "model.lora={r:2,alpha:4,target_modules:[q_proj,v_proj]}"
DATA = ['model.pad_token="</s>"', "dataset=text", "dataset.train_file=train.csv",
        "dataset.test_file=train.csv", "dataset.text_column=review", "dataset.label_column=label",
        "dataset.max_len=16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_quantize_cli")
    save_tiny(root / "llama", "llama")
    write_csv(root / "train.csv", review_rows(TRAIN_ROWS))
    return root


@pytest.mark.parametrize("quantize, mode, dtype", [("int8", "ghost", "float32"),
                                                   ("nf4", "hooks", "float32"),
                                                   ("nf4", "ghost", "bfloat16")])
def test_a_quantized_base_trains_its_adapters_privately_through_the_command(
        files: Path, quantize: str, mode: str, dtype: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    run_dir = files / f"run_{quantize}_{mode}_{dtype}"
    code, _, err = run_in_process(
        [*QUIET, "model=hf", "model.name_or_path=./llama", LORA, f"model.quantize={quantize}", f"model.dtype={dtype}",
         *DATA, f"privacy.grad_sample_mode={mode}", "train.epochs=1", f"train.batch_size={BATCH}",
         "train.max_physical_batch_size=5", f"hydra.run.dir={run_dir}"], files, monkeypatch, capsys)
    assert code == 0, err
    ledger, result = read_json(run_dir / "privacy_ledger.json"), read_json(run_dir / "result.json")
    assert result["status"] == "completed" and ledger["config"]["model"]["quantize"] == quantize
    history = [(h["noise_multiplier"], h["sample_rate"], h["steps"]) for h in ledger["history"]]
    assert sum(steps for *_, steps in history) == TRAIN_ROWS // BATCH
    assert ledger["epsilon"] == pytest.approx(compute_epsilon(history, ledger["delta"],
                                                              ledger["accountant"]), rel=1e-9)
    released = torch.load(run_dir / "model.pt", weights_only=True)
    assert any(bool(t.abs().sum() > 0) for name, t in released.items() if "lora_B" in name)  # trained
    assert json.loads((run_dir / "model_hf" / "adapter_config.json").read_text())["r"] == 2


def test_a_quantized_base_without_lora_is_refused_naming_both_keys(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_in_process([*QUIET, "model=hf", "model.name_or_path=./llama",
                                   "model.quantize=int8", *DATA, "hydra.run.dir=refused"],
                                  files, monkeypatch, capsys)
    assert code == 2, err
    assert "model.quantize=int8 needs model.lora" in err and not (files / "refused" / "metrics.jsonl").exists()


def test_a_config_recorded_before_model_quantize_is_the_run_with_an_unquantized_base() -> None:
    old = {"model": {"name_or_path": "./llama", "lora": {"r": 2}}}
    unquantized = {"model": {**old["model"], "quantize": None}}
    assert config_hash(old) == config_hash(unquantized) and config_differences(old, unquantized) == []
    assert config_differences(old, {"model": {**old["model"], "quantize": "nf4"}}) == ["model.quantize"]
