"""LoRA over a quantized frozen base (QLoRA, `build_hf_model(quantize=...)`): exact adapters.

Tiny random-init Llama (causal LM) and BERT (classifier) checkpoints (tests/hf_tiny.py) loaded
with their Linear layers in 8 bits (bitsandbytes' int8, float64 everywhere else) or 4 bits (NF4,
float32: bitsandbytes refuses 4-bit float64), LoRA adapters over them. The adapters' per-sample
gradients, in hooks and ghost mode, are checked against micro-batch recomputation (each example
alone, its own loss), and the wrappers are checked to capture the adapters, never the quantized
layers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError
from dptrain.grad_sample.check import microbatch_grad_samples, wrapped_grad_samples
from dptrain.grad_sample.coverage import fallback_layers
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.losses import IGNORE_INDEX
from dptrain.models.hf import HFModel, build_hf_model, loss_for_task, pack_inputs, stored_bytes
from tests.grad_sample.hf_zoo import record_captured_layers
from tests.hf_tiny import save_tiny

bnb = pytest.importorskip("bitsandbytes")

BATCH, LENGTH = 4, 6
TASKS = {"llama": "causal_lm", "bert": "sequence_classification"}
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "bert": ["query", "value"]}
DTYPES = {"int8": "float64", "nf4": "float32"}
# float64 (int8): the tolerance of the unquantized models' tests (tests/grad_sample/
# test_hf_models.py). float32 (nf4): the batch and each example alone sum the same products in
# another order (matmuls over B*T rows against T rows), each sum rounded at float32's unit
# round-off 6e-8 through the model's two blocks: 1e-5 of the largest gradient entry is about a
# hundred round-offs, and a gradient that missed a term (another example's, or a layer's) is off
# by the size of that term, orders of magnitude more. Measured: 5e-17 (int8), 4.5e-7 absolute on
# gradients of size 0.1-1 (nf4).
RELATIVE_TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qlora")
    return {kind: save_tiny(root / kind, kind, dropout=0.0) for kind in TASKS}


def quantized(folders: dict[str, Path], kind: str, quantize: str, **kwargs: Any) -> HFModel:
    """The tiny `kind` model, base quantized, rank-2 adapters with a random B (PEFT starts B at 0,
    which would leave every gradient through an adapter's A trivially 0)."""
    torch.manual_seed(0)
    model = build_hf_model(str(folders[kind]), task=TASKS[kind], num_labels=2,
                           dtype=kwargs.pop("dtype", None) or DTYPES[quantize], quantize=quantize,
                           lora={"r": 2, "alpha": 4, "target_modules": TARGETS[kind]},
                           pad_token="</s>" if kind == "llama" else None, **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def batch(kind: str) -> tuple[Tensor, Tensor]:
    """A right-padded `[B, 2T]` batch and its targets (next tokens, or labels)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 30, (BATCH, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 4:], mask[3, 2:] = 0, 0
    targets = ids.masked_fill(mask == 0, IGNORE_INDEX) if kind == "llama" else torch.tensor([0, 1, 1, 0])
    return pack_inputs(ids, mask), targets


def quantized_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))]


def assert_close_to(got: dict[str, Tensor], truth: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Every parameter's per-sample gradients within RELATIVE_TOL of the largest entry of the
    truth's."""
    assert got.keys() == truth.keys() and truth
    tol = RELATIVE_TOL[str(dtype).removeprefix("torch.")]
    for name, expected in truth.items():
        scale = expected.abs().max().item()
        assert scale > 0, name  # no gradient trivially 0
        assert (got[name] - expected).abs().max().item() <= tol * scale, name


CASES = [(kind, quantize) for kind in TASKS for quantize in DTYPES]
IDS = [f"{kind}-{quantize}" for kind, quantize in CASES]


@pytest.mark.parametrize(("kind", "quantize"), CASES, ids=IDS)
def test_adapter_per_sample_gradients_over_a_quantized_base_equal_micro_batch_recomputation(
        folders, kind, quantize) -> None:
    model = quantized(folders, kind, quantize)
    x, y = batch(kind)
    loss_fn = loss_for_task(TASKS[kind])
    truth = microbatch_grad_samples(model, (x,), y, loss_fn)
    got = wrapped_grad_samples(model, (x,), y, loss_fn, True, "mean")
    assert quantized_layers(model) and all(".lora_" in n or "modules_to_save" in n for n in truth)
    assert_close_to(got, truth, next(p.dtype for p in model.parameters() if p.requires_grad))


def clipped(per_sample: dict[str, Tensor], bound: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Each example's gradient norm `[B]` and `{name: sum_b min(1, C/||g_b||) g_b}`."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
    factors = (bound / norms).clamp(max=1.0)
    return norms, {n: torch.einsum("b,b...->...", factors.to(g.dtype), g) for n, g in per_sample.items()}


@pytest.mark.parametrize(("kind", "quantize"), CASES, ids=IDS)
def test_ghost_norms_and_clipped_sums_over_a_quantized_base_equal_micro_batch_recomputation(
        folders, kind, quantize) -> None:
    model = quantized(folders, kind, quantize)
    x, y = batch(kind)
    loss_fn = loss_for_task(TASKS[kind])
    truth = microbatch_grad_samples(model, (x,), y, loss_fn)
    norms, _ = clipped(truth, 1.0)
    bound = norms.median().item()  # about half the examples clipped
    expected_norms, expected_sums = clipped(truth, bound)
    ghost = GhostClippingModule(model, loss_reduction="mean")
    loss_fn(ghost(x), y).backward()
    names = dict(ghost.trainable_parameters())
    got_norms = torch.stack(list(ghost.squared_norms().values())).sum(0).sqrt()
    factors = (bound / got_norms).clamp(max=1.0)
    sums = ghost.weighted_sum({p: factors for p in names.values()})
    tol = RELATIVE_TOL[DTYPES[quantize]]
    assert (got_norms - expected_norms).abs().max() <= tol * expected_norms.max()
    assert_close_to({n: sums[p].unsqueeze(0) for n, p in names.items()},
                    {n: s.unsqueeze(0) for n, s in expected_sums.items()}, getattr(torch, DTYPES[quantize]))


@pytest.mark.parametrize("wrapper_cls", [GradSampleModule, GhostClippingModule], ids=["hooks", "ghost"])
@pytest.mark.parametrize("quantize", list(DTYPES))
def test_the_wrappers_capture_the_adapters_and_never_the_quantized_layers(
        folders, quantize, wrapper_cls, monkeypatch) -> None:
    seen = record_captured_layers(wrapper_cls, monkeypatch)
    model = quantized(folders, "llama", quantize)
    x, y = batch("llama")
    wrapper = wrapper_cls(model)
    loss_for_task("causal_lm")(wrapper(x), y).backward()
    assert seen and all(".lora_" in path for path in seen), sorted(seen)
    layers = quantized_layers(model)
    assert layers and not any(p.requires_grad for layer in layers for p in layer.parameters(recurse=False))
    assert fallback_layers(model) == {"hooks": [], "ghost": []}


@pytest.mark.parametrize("kind", list(TASKS))
def test_the_heads_stay_unquantized_and_train(folders, kind) -> None:
    """The output layer and a classifier head (trained whole by PEFT) keep model.dtype."""
    model = quantized(folders, kind, "int8")
    heads = [m for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and {"lm_head", "classifier", "score"} & set(n.split("."))]
    assert heads and not quantized_layers(nn.ModuleList(heads))
    assert kind == "llama" or any(p.requires_grad for h in heads for p in h.parameters())


@pytest.mark.parametrize(("quantize", "dtype"), [("int8", "float64"), ("int8", "bfloat16"),
                                                 ("nf4", "bfloat16")])
def test_the_trainable_parameters_have_the_dtypes_of_the_unquantized_path(folders, quantize, dtype) -> None:
    """Adapters in model.dtype (float32 from 16 bits), the head in model.dtype: as over an
    unquantized base, so that a float64 check computes in float64 and a 16-bit head takes the
    16-bit hidden states."""
    def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
        return {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}

    plain = build_hf_model(str(folders["bert"]), num_labels=2, dtype=dtype,
                           lora={"r": 2, "alpha": 4, "target_modules": TARGETS["bert"]})
    assert dtypes(quantized(folders, "bert", quantize, dtype=dtype)) == dtypes(plain)


def test_an_int8_examples_outputs_do_not_depend_on_the_other_examples_of_its_batch(folders) -> None:
    """LLM.int8's outlier threshold (transformers' default 6) computes in 16 bits the input columns
    where any token of the batch exceeds it: one example's outlier would change the others'
    outputs (bitsandbytes' int8 kernel: CPU evaluation, CUDA training). The threshold is 0."""
    model = quantized(folders, "llama", "int8").eval()
    layer = quantized_layers(model)[0]
    inputs = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)
    inputs[1, 0, 3] = 20.0  # an outlier in the second example only
    with torch.no_grad():
        assert torch.equal(layer(inputs)[0], layer(inputs[:1])[0])


def test_4bit_layers_keep_the_layout_that_backpropagates(folders, monkeypatch) -> None:
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer evaluated without gradients
    for an inference kernel through which no gradient flows; the layers are told not to."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)  # as on such a CPU
    model = quantized(folders, "llama", "nf4")
    layers = quantized_layers(model)
    assert layers and not any(layer.support_avx512bf16_for_cpu for layer in layers)


def test_an_int8_layer_is_stored_in_a_byte_per_weight_and_its_row_scales(folders) -> None:
    model = quantized(folders, "llama", "int8")
    layer = quantized_layers(model)[0]
    rows, columns = layer.weight.shape
    assert stored_bytes(layer) == rows * columns + 4 * rows  # int8 codes, float32 scales


def test_quantizing_without_lora_is_refused_naming_model_quantize_and_model_lora(folders) -> None:
    with pytest.raises(ConfigError, match=r"model\.quantize=int8 needs model\.lora.*frozen"):
        build_hf_model(str(folders["bert"]), quantize="int8")


def test_nf4_in_float64_is_refused_naming_model_dtype(folders) -> None:
    with pytest.raises(ConfigError, match=r"model\.quantize=nf4 with model\.dtype=float64"):
        quantized(folders, "bert", "nf4", dtype="float64")


def test_an_unknown_quantization_is_refused_listing_the_choices(folders) -> None:
    with pytest.raises(ConfigError, match=r"model\.quantize='int4'.*int8 or nf4"):
        quantized(folders, "bert", "int4", dtype="float32")


def test_quantizing_without_bitsandbytes_is_refused_saying_how_to_install_it(folders, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    with pytest.raises(ConfigError, match=r"model\.quantize=nf4 needs the bitsandbytes.*dptrain\[quantize\]"):
        quantized(folders, "bert", "nf4")
