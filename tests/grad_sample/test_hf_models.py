"""Hugging Face models, full fine-tuning and LoRA: exact per-sample gradients, ghost = hooks.

Every model of :mod:`tests.grad_sample.hf_zoo` (BERT, RoBERTa, DistilBERT, GPT-2 classifier and
LM, Llama LM, ViT, nanoGPT-style positions, Gemma 2 and Gemma 3 causal LMs and classifiers with
eager and sdpa attention) in float64, on a right-padded batch, against micro-batch
recomputation (each sample alone, its own loss).
"""

import re

import pytest
import torch
from torch import nn

from dptrain.errors import ConfigError, UnsupportedModuleError
from dptrain.grad_sample.check import check_per_sample_gradients, microbatch_grad_samples
from dptrain.grad_sample.coverage import fallback_layers
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from tests.grad_sample.hf_zoo import (GEMMA, LORA_TARGETS, MODELS, gemma_norms_in_float64, make_case,
                                     record_captured_layers)
from tests.grad_sample.test_ghost_support import REGIMES, assert_ghost_matches_hooks

MODES = [False, True]
MODE_IDS = ["full", "lora"]
# Llama's RMSNorm normalises in float32 whatever the input dtype, so the gradients reaching the
# layers before it carry float32 rounding, which differs between a batch and a single sample.
# Gemma's RMSNorm computes norm(x) * (1 + w) in float32 likewise (measured: up to 2.3e-6), and
# transformers' eager attention takes its softmax in float32 (up to 4.2e-7 with the norms in float64).
TOL = {"llama_lm": 1e-6, **{name: 1e-5 for name in GEMMA}}


@pytest.mark.parametrize("lora", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", MODELS)
def test_per_sample_gradients_equal_micro_batch_recomputation(name, lora) -> None:
    case = make_case(name, lora)
    errors = check_per_sample_gradients(case.model, case.inputs, case.targets, case.loss_fn)
    assert errors
    worst = {n: e for n, e in errors.items() if not e <= TOL.get(name, 1e-10)}
    assert not worst, worst


@pytest.mark.parametrize("lora", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", GEMMA)
def test_gemma_per_sample_gradients_are_exact_when_the_model_is_float64_throughout(name, lora) -> None:
    # Gemma's norms in float64: sdpa attention is then float64 end to end (exact to round-off);
    # eager attention keeps transformers' float32 softmax.
    with gemma_norms_in_float64():
        case = make_case(name, lora)
        errors = check_per_sample_gradients(case.model, case.inputs, case.targets, case.loss_fn)
    tolerance = 1e-12 if "_sdpa" in name else 1e-6
    worst = {n: e for n, e in errors.items() if not e <= tolerance}
    assert not worst, worst


@pytest.mark.parametrize("name", GEMMA)
def test_gemma_ghost_norms_equal_the_norms_of_micro_batch_gradients(name) -> None:
    # Ghost mode forms no per-sample gradient whose sum could be audited: a rule missing the
    # embedding's scale (sqrt(hidden_size)) gave norms hidden_size times too small, silently.
    case = make_case(name)
    truth = microbatch_grad_samples(case.model, case.inputs, case.targets, case.loss_fn)
    ghost = GhostClippingModule(case.model)
    case.loss_fn(ghost(*case.inputs), case.targets).backward()
    norms = ghost.squared_norms()
    for param_name, p in ghost.trainable_parameters():
        expected = truth[param_name].flatten(1).square().sum(1)
        torch.testing.assert_close(norms[p], expected, rtol=1e-5, atol=1e-12, msg=param_name)


def test_the_gemma_word_embedding_is_scaled_and_tied_to_the_lm_head_and_both_stay_ghost() -> None:
    case = make_case("gemma2_lm")
    embedding = case.model.model.model.embed_tokens
    assert float(embedding.embed_scale) != 1.0 and case.model.model.lm_head.weight is embedding.weight
    ghost = GhostClippingModule(case.model)
    case.loss_fn(ghost(*case.inputs), case.targets).backward()
    strategies = ghost.layer_strategies()
    assert strategies["model.model.embed_tokens"] == strategies["model.lm_head"] == "ghost"


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("lora", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", MODELS)
def test_ghost_clipped_sums_equal_hooks_mode(name, lora, regime) -> None:
    case = make_case(name, lora)
    assert_ghost_matches_hooks(case.model, case.inputs, regime, case.targets, case.loss_fn, reduction="mean")


@pytest.mark.parametrize("name", MODELS)
def test_no_layer_falls_back_to_torch_func(name) -> None:
    assert fallback_layers(make_case(name).model) == {"hooks": [], "ghost": []}


def test_the_tied_lm_head_of_gpt2_stays_on_the_ghost_path() -> None:
    case = make_case("gpt2_lm")
    ghost = GhostClippingModule(case.model)
    case.loss_fn(ghost(*case.inputs), case.targets).backward()
    strategies = ghost.layer_strategies()
    assert strategies["model.transformer.wte"] == strategies["model.lm_head"] == "ghost"


def _captured_layers(wrapper_cls: type, name: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Paths of the layers whose backward the wrapper processed on one LoRA pass."""
    seen = record_captured_layers(wrapper_cls, monkeypatch)
    case = make_case(name, lora=True)
    wrapper = wrapper_cls(case.model)
    case.loss_fn(wrapper(*case.inputs), case.targets).backward()
    return seen


@pytest.mark.parametrize("wrapper_cls", [GradSampleModule, GhostClippingModule], ids=["hooks", "ghost"])
@pytest.mark.parametrize("name", ["bert", "gpt2_lm"])
def test_frozen_base_layers_of_a_lora_model_are_never_captured(name, wrapper_cls, monkeypatch) -> None:
    seen = _captured_layers(wrapper_cls, name, monkeypatch)
    assert seen and all(".lora_" in path or "modules_to_save" in path for path in seen), sorted(seen)


def test_a_lora_model_without_trainable_parameter_is_refused_naming_its_target_modules() -> None:
    case = make_case("bert", lora=True)
    case.model.requires_grad_(False)
    targets = re.escape(f"target_modules={sorted(LORA_TARGETS['bert'])}")
    with pytest.raises(ConfigError, match=rf"{targets}.*is_trainable=True"):
        GradSampleModule(case.model)


def test_a_batchnorm_in_a_hf_model_is_refused_naming_its_path() -> None:
    case = make_case("roberta")
    case.model.model.classifier.dense = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 8))
    with pytest.raises(UnsupportedModuleError, match=r"'model\.classifier\.dense\.0'.*BatchNorm1d"):
        GhostClippingModule(case.model)
