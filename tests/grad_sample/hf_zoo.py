"""Tiny random-init Hugging Face models, float64, for the per-sample gradient tests (no tests here).

Each case is a model wrapped to return ``.logits``, a padded batch, targets and a loss with "one
sample, one loss" semantics: cross-entropy per sample for classifiers, :class:`dptrain.TokenLoss`
(mean over the sample's own non-padded tokens) for causal LMs. ``lora=True`` wraps the HF model
with ``peft.get_peft_model`` (adapters randomly initialised, so that no gradient is trivially 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

from dptrain.losses import TokenLoss

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

F64 = torch.float64
VOCAB, WIDTH, HEADS, LAYERS, CLASSES, BATCH, SEQ = 40, 8, 2, 2, 3, 3, 6
PAD = 0


class Logits(nn.Module):
    """``model(input_ids, attention_mask=mask).logits`` (``pixel_values`` for vision models)."""

    def __init__(self, model: nn.Module, vision: bool = False) -> None:
        super().__init__()
        self.model, self.vision = model, vision

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.vision:
            return self.model(pixel_values=x).logits
        return self.model(input_ids=x, attention_mask=mask).logits


class NanoGPT(nn.Module):
    """nanoGPT's embedding: ``wte(idx) + wpe(arange(T))`` (positions with no batch dimension),
    one causal self-attention block of Linear layers, and an LM head tied to ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.c_attn, self.c_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        q, k, v = self.c_attn(self.ln(x)).split(WIDTH, dim=2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.lm_head(x + self.c_proj(y))


@dataclass
class Case:
    """One model of the matrix: ``loss_fn(model(*inputs), targets)`` is the batch loss (mean)."""

    name: str
    model: nn.Module
    inputs: tuple[Tensor, ...]
    targets: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]


def _text_batch() -> tuple[Tensor, Tensor]:
    """``[B, T]`` token ids right-padded with PAD, and the attention mask."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return ids * mask + PAD * (1 - mask), mask


def _lm_labels(ids: Tensor, mask: Tensor) -> Tensor:
    """Causal-LM labels: the ids, -100 at padding."""
    return ids.masked_fill(mask == 0, -100)


def _dropout_free(config_cls: type, **kwargs) -> object:
    """A config with every dropout at 0 (micro-batch recomputation needs a deterministic forward)."""
    zero = {
        k: 0.0
        for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                  "summary_first_dropout", "dropout", "attention_dropout", "seq_classif_dropout", "classifier_dropout")
    }
    return config_cls(**{**zero, **kwargs})


def _hf_model(name: str) -> tuple[nn.Module, str]:
    """The HF model of ``name`` and its PEFT task type."""
    t = transformers
    text = dict(vocab_size=VOCAB, num_labels=CLASSES, pad_token_id=PAD)
    bert_like = dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                     max_position_embeddings=SEQ + 4, **text)
    if name == "bert":
        return t.BertForSequenceClassification(_dropout_free(t.BertConfig, **bert_like)), "SEQ_CLS"
    if name == "roberta":
        return t.RobertaForSequenceClassification(_dropout_free(t.RobertaConfig, **bert_like)), "SEQ_CLS"
    if name == "distilbert":
        config = _dropout_free(t.DistilBertConfig, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * WIDTH,
                               max_position_embeddings=SEQ, **text)
        return t.DistilBertForSequenceClassification(config), "SEQ_CLS"
    gpt2 = dict(n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ, bos_token_id=1, eos_token_id=1, **text)
    if name == "gpt2_cls":
        return t.GPT2ForSequenceClassification(_dropout_free(t.GPT2Config, **gpt2)), "SEQ_CLS"
    if name == "gpt2_lm":
        return t.GPT2LMHeadModel(_dropout_free(t.GPT2Config, **gpt2)), "CAUSAL_LM"
    if name == "llama_lm":
        config = _dropout_free(t.LlamaConfig, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                               num_key_value_heads=1, intermediate_size=2 * WIDTH, max_position_embeddings=SEQ,
                               bos_token_id=1, eos_token_id=1, **text)
        return t.LlamaForCausalLM(config), "CAUSAL_LM"
    if name.startswith("gemma"):
        return _gemma(name, text)
    if name == "vit":
        config = _dropout_free(t.ViTConfig, image_size=8, patch_size=4, num_channels=3, hidden_size=WIDTH,
                               num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                               num_labels=CLASSES)
        return t.ViTForImageClassification(config), "SEQ_CLS"
    raise ValueError(name)


def _gemma(name: str, text: dict) -> tuple[nn.Module, str]:
    """Gemma 2 (eager attention only: transformers offers no sdpa for it) or Gemma 3 (text; eager,
    or sdpa for ``gemma3_sdpa_*``), causal LM (``*_lm``) or sequence classifier (``*_cls``).

    Both ties the LM head to the scaled word embedding (sqrt(hidden_size)), as the checkpoints do;
    layer 0 is a sliding-window layer, layer 1 a full one. The window (8) covers the sequence: in
    float64, transformers' own sliding mask on a right-padded row shorter than the window gives NaN
    (its two masks add to -inf), in float32 it does not.
    """
    t = transformers
    family = name.split("_")[0]
    common = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=1, head_dim=4, query_pre_attn_scalar=4, max_position_embeddings=SEQ,
                  sliding_window=SEQ + 2, layer_types=["sliding_attention", "full_attention"],
                  bos_token_id=1, eos_token_id=1, attn_implementation="sdpa" if "_sdpa" in name else "eager", **text)
    config = _dropout_free(t.Gemma2Config if family == "gemma2" else t.Gemma3TextConfig, **common)
    if name.endswith("_lm"):
        cls = t.Gemma2ForCausalLM if family == "gemma2" else t.Gemma3ForCausalLM
        return cls(config), "CAUSAL_LM"
    cls = t.Gemma2ForSequenceClassification if family == "gemma2" else t.Gemma3TextForSequenceClassification
    return cls(config), "SEQ_CLS"


def _gemma_norm_in_input_dtype(self: nn.Module, x: Tensor) -> Tensor:
    """Gemma's RMSNorm, ``norm(x) * (1 + w)``, computed in ``x``'s dtype (transformers' own forward
    computes it in float32 whatever the input: float32 rounding that a float64 batch and a float64
    sample alone do not share)."""
    return self._norm(x) * (1.0 + self.weight)


@contextmanager
def gemma_norms_in_float64() -> Iterator[None]:
    """Gemma 2 / 3 RMSNorms computed in their input's dtype while the context is open, so that a
    float64 model is float64 throughout and micro-batch recomputation can check it to 1e-10."""
    classes = [transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm,
               transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm]
    originals = [cls.forward for cls in classes]
    try:
        for cls in classes:
            cls.forward = _gemma_norm_in_input_dtype
        yield
    finally:
        for cls, forward in zip(classes, originals):
            cls.forward = forward


GEMMA = ("gemma2_lm", "gemma2_cls", "gemma3_lm", "gemma3_cls", "gemma3_sdpa_lm", "gemma3_sdpa_cls")

# Adapter targets per model (attention query/value, as in the LoRA paper).
LORA_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "gpt2_cls": ["c_attn"],
    "gpt2_lm": ["c_attn"],
    "llama_lm": ["q_proj", "v_proj"],
    "vit": ["q_proj", "v_proj"],
    "nanogpt": ["c_attn"],
    **{name: ["q_proj", "v_proj"] for name in GEMMA},
}
CLASSIFIERS = {"vit": ["classifier"]}  # modules_to_save where PEFT's task type does not name them
MODELS = tuple(LORA_TARGETS)


def _lora_targets(model: nn.Module, name: str) -> list[str]:
    """:data:`LORA_TARGETS`, or the query/value names of transformers < 5 (ViT's query, value)."""
    names = {path.rpartition(".")[2] for path, _ in model.named_modules()}
    targets = LORA_TARGETS[name]
    return targets if set(targets) <= names else ["query", "value"]


def with_lora(model: nn.Module, name: str, task_type: str | None) -> nn.Module:
    """``peft.get_peft_model`` with rank-2 adapters on :data:`LORA_TARGETS` (random init)."""
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=_lora_targets(model, name), task_type=task_type, init_lora_weights=False,
        fan_in_fan_out=name.startswith("gpt2"), modules_to_save=CLASSIFIERS.get(name),
    )
    return peft.get_peft_model(model, config)


def make_case(name: str, lora: bool = False) -> Case:
    """The float64 case ``name`` (one of :data:`MODELS`), full fine-tuning or LoRA."""
    torch.manual_seed(0)
    if name == "nanogpt":
        model: nn.Module = NanoGPT()
        task = None
    else:
        model, task = _hf_model(name)
    if lora:
        model = with_lora(model, name, task)
    wrapped = (model if name == "nanogpt" else Logits(model, vision=name == "vit")).double().train()
    if name == "vit":
        return Case(name, wrapped, (torch.randn(BATCH, 3, 8, 8, dtype=F64),), torch.tensor([0, 2, 1]),
                    nn.CrossEntropyLoss())
    ids, mask = _text_batch()
    if name.endswith("_lm") or name == "nanogpt":
        return Case(name, wrapped, (ids, mask), _lm_labels(ids, mask), TokenLoss())
    return Case(name, wrapped, (ids, mask), torch.tensor([0, 2, 1]), nn.CrossEntropyLoss())


def record_captured_layers(wrapper_cls: type, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """A set that collects the path of every layer whose backward a `wrapper_cls` instance
    processes from now on (its `_on_backprop`, patched for the test)."""
    seen: set[str] = set()
    original = wrapper_cls._on_backprop

    def record(self, call, activations, backprops):
        seen.add(call.name)
        return original(self, call, activations, backprops)

    monkeypatch.setattr(wrapper_cls, "_on_backprop", record)
    return seen
