"""Mixture-of-experts models of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): exact
per-sample gradients of the router and the fused experts, ghost = hooks, full and LoRA.

Tolerances. The sparse blocks alone are compared in float64 at 1e-10 (the experts' rules against
micro-batches of the same float64 block; the router's softmax runs in float32 in every family, but
on identical inputs in the batch and alone). Whole models in float64 agree to 1e-6: their RMS norms
normalise in float32 whatever the input dtype (as Llama's, tests/grad_sample/test_hf_models.py),
so every gradient before a norm carries float32 rounding that differs between a batch and one
sample. transformers' default experts kernel (``grouped_mm``) takes no float64, so the float64
checks run the ``eager`` and ``batched_mm`` kernels (same math, chosen by ``experts_implementation``)
and the default kernel is checked in float32, relative to each gradient's size (``FLOAT32_RTOL``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.check import check_per_sample_gradients, microbatch_grad_samples, wrapped_grad_samples
from dptrain.grad_sample.coverage import fallback_layers
from dptrain.grad_sample.hf_moe import EXPERTS, FAMILIES, MOE_BLOCKS, ROUTERS, per_expert_outer_grads, per_expert_sq_norms
from dptrain.grad_sample.module import GradSampleModule
from dptrain.grad_sample.registry import TOKEN_FLATTENING, register_token_flattening
from dptrain.losses import TokenLoss
from tests.grad_sample.hf_zoo import Logits, _lm_labels, _text_batch
from tests.grad_sample.test_ghost_support import assert_ghost_matches_hooks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

F64 = torch.float64
WIDTH, EXPERT_COUNT, TOP_K, INNER = 8, 4, 2, 8  # widths of 16-byte multiples: grouped_mm needs them
FAMILY_NAMES = [module for module, _ in FAMILIES]
MODEL_TOL = 1e-6
FLOAT32_RTOL = 1e-4  # float32 round-off (~1e-7 per operation) grown through two layers and a softmax
LORA_TARGETS = {  # attention, and Qwen2-MoE's shared expert (Linear layers on the flattened tokens)
    "mixtral": ["q_proj", "v_proj"],
    "qwen2_moe": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"],
    "qwen3_moe": ["q_proj", "v_proj"],
    "olmoe": ["q_proj", "v_proj"],
}


def _config(family: str) -> object:
    """A tiny config of ``family``: 2 layers, width 8, 4 experts of width 8, top-2."""
    t = transformers
    common = dict(vocab_size=40, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                  eos_token_id=1, num_experts_per_tok=TOP_K, intermediate_size=INNER)
    if family == "mixtral":
        return t.MixtralConfig(num_local_experts=EXPERT_COUNT, **common)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(num_experts=EXPERT_COUNT, moe_intermediate_size=INNER,
                                shared_expert_intermediate_size=10, **common)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(num_experts=EXPERT_COUNT, moe_intermediate_size=INNER, head_dim=4, **common)
    return t.OlmoeConfig(num_experts=EXPERT_COUNT, **common)


def _randomise_routers(model: nn.Module) -> None:
    """Qwen and OLMoE routers start at zero (all experts tie): draw them, so routing is uneven."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and not p.any():
                p.normal_(0.0, 0.5)


def moe_lm(family: str, implementation: str = "eager", lora: bool = False) -> nn.Module:
    """The tiny causal LM of ``family`` with the experts kernel ``implementation``, returning logits."""
    torch.manual_seed(0)
    cls = getattr(transformers, f"{dict(FAMILIES)[family]}ForCausalLM")
    model = cls._from_config(_config(family), experts_implementation=implementation)
    _randomise_routers(model)
    if lora:
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS[family], init_lora_weights=False,
                                 task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    return Logits(model).train()


def moe_block(family: str) -> nn.Module:
    """The sparse block of ``family`` alone (eager experts), every weight drawn."""
    torch.manual_seed(0)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = _config(family)
    config._experts_implementation = "eager"
    block = getattr(module, f"{dict(FAMILIES)[family]}SparseMoeBlock")(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block.double().train()


def _lm_batch() -> tuple[tuple[Tensor, Tensor], Tensor]:
    ids, mask = _text_batch()
    return (ids, mask), _lm_labels(ids, mask)


def square_loss(output: Tensor, target: Tensor) -> Tensor:
    """Each sample's squared distance to its target, summed (one loss per sample)."""
    return ((output - target) ** 2).sum()


# ---------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sparse_block_per_sample_gradients_are_exact_in_float64(family) -> None:
    block = moe_block(family)
    x, y = torch.randn(3, 5, WIDTH, dtype=F64), torch.randn(3, 5, WIDTH, dtype=F64)
    errors = check_per_sample_gradients(block, (x,), y, square_loss, loss_reduction="sum")
    assert {n for n in errors if "gate" in n or "experts" in n} >= {"gate.weight", "experts.gate_up_proj"}
    assert max(errors.values()) <= 1e-10, errors


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_moe_lm_per_sample_gradients_equal_micro_batch_recomputation(family, lora, implementation) -> None:
    model = moe_lm(family, implementation, lora).double()
    inputs, labels = _lm_batch()
    errors = check_per_sample_gradients(model, inputs, labels, TokenLoss())
    trained = {n for n in errors if "experts" in n or n.endswith("mlp.gate.weight")}
    assert bool(trained) == (not lora)
    assert max(errors.values()) <= MODEL_TOL, {n: e for n, e in errors.items() if e > MODEL_TOL}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_default_grouped_mm_kernel_gets_the_same_per_sample_gradients_in_float32(family) -> None:
    model = moe_lm(family, "grouped_mm")
    inputs, labels = _lm_batch()
    truth = microbatch_grad_samples(model, inputs, labels, TokenLoss())
    got = wrapped_grad_samples(model, inputs, labels, TokenLoss())
    for name, expected in truth.items():
        scale = expected.abs().max().clamp(min=1e-30)
        assert (got[name] - expected).abs().max() <= FLOAT32_RTOL * scale, name


def test_per_sample_gradients_add_up_to_the_gradient_under_the_backward_audit() -> None:
    model = moe_lm("mixtral").double()
    inputs, labels = _lm_batch()
    gsm = GradSampleModule(model)  # the audit raises if a parameter's rows do not sum to its .grad
    TokenLoss()(gsm(*inputs), labels).backward()
    experts = model.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad_sample.shape == (3, EXPERT_COUNT, 2 * INNER, WIDTH)
    assert experts.down_proj.grad_sample.shape == (3, EXPERT_COUNT, WIDTH, INNER)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_no_moe_layer_falls_back_to_torch_func(family) -> None:
    assert fallback_layers(moe_lm(family)) == {"hooks": [], "ghost": []}


# ---------------------------------------------------------------------------------- ghost
@pytest.mark.parametrize("strategy", ["ghost", "auto"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sparse_block_ghost_norms_and_clipped_sums_equal_hooks_mode(family, strategy) -> None:
    block = moe_block(family)
    ghost = assert_ghost_matches_hooks(block, (torch.randn(3, 5, WIDTH, dtype=F64),), "mixed", strategy=strategy)
    if strategy == "ghost":
        assert ghost.layer_strategies()["experts"] == ghost.layer_strategies()["gate"] == "ghost"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_moe_lm_ghost_clipped_sums_equal_hooks_mode(family, lora) -> None:
    model = moe_lm(family, lora=lora).double()
    inputs, labels = _lm_batch()
    assert_ghost_matches_hooks(model, inputs, "mixed", labels, TokenLoss(), reduction="mean", strategy="ghost")


def test_masked_gram_norms_equal_the_norms_of_the_per_expert_gradients() -> None:
    torch.manual_seed(1)
    a, g = torch.randn(4, 10, 5, dtype=F64), torch.randn(4, 10, 7, dtype=F64)
    expert = torch.randint(0, 3, (4, 10))
    grads = per_expert_outer_grads(a, g, expert, 3)
    exact = grads.flatten(1).square().sum(dim=1)
    bound = per_expert_sq_norms(a, g, expert)
    assert torch.all(bound >= exact) and torch.allclose(bound, exact, rtol=1e-12, atol=0)


def test_masked_gram_norms_stay_upper_bounds_in_float32_for_cancelling_samples() -> None:
    torch.manual_seed(2)
    a = torch.randn(2, 8, 16)
    g = torch.randn(2, 8, 16)
    a[:, 4:] = a[:, :4]
    g[:, 4:] = -g[:, :4] * (1 + 1e-6)  # slots 4..7 nearly cancel slots 0..3 of the same expert
    expert = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    exact = per_expert_outer_grads(a.double(), g.double(), expert, 4).flatten(1).square().sum(dim=1)
    assert torch.all(per_expert_sq_norms(a, g, expert).double() >= exact)


# ---------------------------------------------------------------------------------- the engine's property
class FlatBlock(nn.Module):
    """``fc(x.reshape(-1, F)).view_as(x)``: a Linear over the flattened tokens, in any layout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.reshape(-1, x.shape[-1])).view_as(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block = nn.Linear(3, 4), FlatBlock()

    def forward(self, x: Tensor) -> Tensor:
        return self.block(torch.tanh(self.inp(x)))


@pytest.fixture
def flat_block_registered():
    register_token_flattening(FlatBlock)
    yield
    del TOKEN_FLATTENING[FlatBlock]


def test_a_layer_on_flattened_tokens_outside_a_flattening_module_is_still_refused() -> None:
    with pytest.raises(UnsupportedModuleError, match="block.fc"):
        gsm = GradSampleModule(Net().double())
        gsm(torch.randn(3, 5, 3, dtype=F64)).sum().backward()


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_flattened_tokens_are_assigned_to_their_samples_in_either_layout(flat_block_registered, batch_first) -> None:
    x = torch.randn(3, 5, 3, dtype=F64) if batch_first else torch.randn(5, 3, 3, dtype=F64)
    y = torch.randn_like(x[..., :1].expand(*x.shape[:-1], 4))
    y = y if batch_first else y.transpose(0, 1)  # targets are batch first
    model = Net().double()

    def loss(out: Tensor, target: Tensor) -> Tensor:
        return square_loss(out if batch_first else out.transpose(0, 1), target)

    errors = check_per_sample_gradients(model, (x,), y, loss, batch_first=batch_first, loss_reduction="sum")
    assert max(errors.values()) <= 1e-12, errors


def test_a_layer_without_rows_per_token_inside_a_flattening_module_is_refused(flat_block_registered) -> None:
    class Pooling(FlatBlock):
        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x.mean(dim=1))  # one row per sample, not per token

    model = Net().double()
    model.block = Pooling().double()
    gsm = GradSampleModule(model)
    with pytest.raises(UnsupportedModuleError, match="block.fc.*flattens the batch's tokens"):
        gsm(torch.randn(3, 5, 3, dtype=F64))


def test_a_layer_without_a_sampler_inside_a_flattening_module_is_refused(flat_block_registered) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.s

    model = Net().double()
    model.block.fc = Scale().double()
    gsm = GradSampleModule(model)
    with pytest.raises(UnsupportedModuleError, match="flattened tokens.*no grad sampler"):
        gsm(torch.randn(3, 5, 3, dtype=F64)).sum().backward()


def test_every_registered_moe_class_exists_in_the_installed_transformers() -> None:
    for qualified in (*MOE_BLOCKS, *ROUTERS, *EXPERTS):
        module, _, name = qualified.rpartition(".")
        assert hasattr(importlib.import_module(module), name), qualified
