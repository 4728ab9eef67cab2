"""Native per-sample rules for the layers of Hugging Face ``transformers`` that torch does not have.

Registered by qualified class name (see :mod:`~dptrain.grad_sample.registry`), so this module never
imports ``transformers``: the rules apply as soon as a model contains such a layer.

- ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layer): ``y = x W + b`` with the weight
  stored transposed, ``[in, out]``. With ``A = [B, T, in]`` and ``G = [B, T, out]``, sample b's weight
  gradient is ``A_b^T G_b`` ``[in, out]``: the Linear algebra with the operands swapped, so it gets
  the Linear ghost rules too (norm, clipped sum, cost, merging of uses).
- the RMS norms of the Llama family (:data:`SCALE_NORMS`): ``y = s(w) * h(x)`` with ``h`` free of the
  weight and ``s(w)`` either ``w`` or ``1 + w`` (Gemma), elementwise over the last dimension. Sample
  b's weight gradient is ``sum_t G_b[t] * h(x_b[t])``; ``h(x)`` is read off the layer's own forward as
  ``layer(x; w = 1) - layer(x; w = 0)``, exact for both forms (and in the layer's own precision).
- ``ViTEmbeddings``: the class token and position table are added to every sample's patch
  embeddings, so their per-sample gradients are slices of the output gradient (:func:`vit_embeddings_grad_sample`).
- the scaled word embeddings (:data:`SCALED_EMBEDDINGS`: Gemma 1-3, BART, ...): ``nn.Embedding``
  subclasses whose forward is ``embedding(ids) * embed_scale`` (Gemma: sqrt(hidden_size)). The
  gradient reaching the table is the output gradient times the scale, so every ``nn.Embedding``
  rule (per-sample gradients, ghost norms, clipped sums, the cross term of an LM head tied to it)
  serves them on ``G * embed_scale``, the product autograd's own backward forms
  (:func:`scaled_embedding_backprops`). Without these rules the ``nn.Embedding`` ones would apply
  through the class hierarchy and miss the scale.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost_linear import (
    linear_clipped_sum,
    linear_merge_uses,
    linear_norms,
    linear_prefers_ghost,
)
from dptrain.grad_sample.embedding import embedding_grad_sample
from dptrain.grad_sample.ghost_embedding import (
    embedding_clipped_sum,
    embedding_linear_cross_term,
    embedding_norms,
)
from dptrain.grad_sample.ghost_math import as_sequence, weighted_bias_sum
from dptrain.grad_sample.ghost_registry import (
    Use,
    Weights,
    register_clipped_sum,
    register_cross_term,
    register_ghost_cost,
    register_use_merger,
)
from dptrain.grad_sample.norms import sum_to_param
from dptrain.grad_sample.registry import register_grad_sampler, register_norm_sampler

CONV1D = "transformers.pytorch_utils.Conv1D"

# RMS norms whose forward is ``s(w) * h(x)`` (s(w) = w, or 1 + w for the Gemma family), checked
# against each class's source; tests/grad_sample/test_hf_layers.py runs every one that exists.
SCALE_NORMS: tuple[str, ...] = tuple(
    f"transformers.models.{family}.modeling_{family}.{cls}"
    for family, cls in (
        ("llama", "LlamaRMSNorm"),
        ("mistral", "MistralRMSNorm"),
        ("mixtral", "MixtralRMSNorm"),
        ("qwen2", "Qwen2RMSNorm"),
        ("qwen2_moe", "Qwen2MoeRMSNorm"),
        ("qwen3", "Qwen3RMSNorm"),
        ("qwen3_moe", "Qwen3MoeRMSNorm"),
        ("olmoe", "OlmoeRMSNorm"),
        ("phi3", "Phi3RMSNorm"),
        ("gemma", "GemmaRMSNorm"),
        ("gemma2", "Gemma2RMSNorm"),
        ("gemma3", "Gemma3RMSNorm"),
        ("olmo2", "Olmo2RMSNorm"),
        ("granite", "GraniteRMSNorm"),
        ("smollm3", "SmolLM3RMSNorm"),
        ("t5", "T5LayerNorm"),
        ("mt5", "MT5LayerNorm"),
    )
)

VIT_EMBEDDINGS = "transformers.models.vit.modeling_vit.ViTEmbeddings"

# Word embeddings whose forward is ``super().forward(ids) * self.embed_scale`` (a float, or a
# 0-d buffer cast to the weight's dtype), checked against each class's source;
# tests/grad_sample/test_hf_layers.py runs every one that exists.
SCALED_EMBEDDINGS: tuple[str, ...] = tuple(
    f"transformers.models.{family}.modeling_{family}.{cls}"
    for family, cls in (
        ("gemma", "GemmaTextScaledWordEmbedding"),
        ("gemma2", "Gemma2TextScaledWordEmbedding"),
        ("gemma3", "Gemma3TextScaledWordEmbedding"),
        ("gemma3n", "Gemma3nTextScaledWordEmbedding"),
        ("vaultgemma", "VaultGemmaTextScaledWordEmbedding"),
        ("bart", "BartScaledWordEmbedding"),
        ("mbart", "MBartScaledWordEmbedding"),
        ("plbart", "PLBartScaledWordEmbedding"),
        ("m2m_100", "M2M100ScaledWordEmbedding"),
        ("blenderbot", "BlenderbotScaledWordEmbedding"),
        ("biogpt", "BioGptScaledWordEmbedding"),
        ("xglm", "XGLMScaledWordEmbedding"),
        ("trocr", "TrOCRScaledWordEmbedding"),
    )
)


# ---------------------------------------------------------------------------------- Conv1D
@register_grad_sampler(CONV1D)
def conv1d_grad_sample(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of GPT-2's Conv1D.

    Args:
        activations: ``[x]`` with x ``[B, *, in]``.
        backprops: ``[B, *, out]``.

    Returns:
        weight: ``[B, in, out]``; bias: ``[B, out]``.
    """
    a, g = as_sequence(activations[0]), as_sequence(backprops)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = a.transpose(1, 2).to(g.dtype) @ g
    if layer.bias is not None and layer.bias.requires_grad:
        grads[layer.bias] = g.sum(dim=1)
    return grads


# The Linear ghost rules read A [B, T, in] and G [B, T, out] only: the norms (||A_i^T G_i|| =
# ||G_i^T A_i||), the cost rule and the merging of uses serve Conv1D as they are.
register_norm_sampler(CONV1D)(linear_norms)
register_ghost_cost(CONV1D)(linear_prefers_ghost)
register_use_merger(CONV1D)(linear_merge_uses)


@register_clipped_sum(CONV1D)
def conv1d_clipped_sum(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``sum_i w_i grad_i``: weight ``[in, out]`` as ``sum_i w_i A_i^T G_i`` (one matmul), bias ``[out]``.

    Linear's rule with A and G swapped forms ``sum_i w_i A_i^T G_i`` directly in Conv1D's layout.
    """
    weight_only = {p: w for p, w in weights.items() if p is layer.weight}
    sums = linear_clipped_sum(layer, [backprops], activations[0], weight_only)
    if layer.bias is not None and layer.bias in weights:
        sums[layer.bias] = weighted_bias_sum(as_sequence(backprops), weights[layer.bias])
    return sums


# ---------------------------------------------------------------------------------- RMS norms
@register_grad_sampler(*SCALE_NORMS)
def scale_norm_grad_sample(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradient of the weight ``[D]`` of an ``s(w) * h(x)`` norm: ``[B, D]``.

    Args:
        activations: ``[x]`` with x ``[B, *, D]``.
        backprops: ``[B, *, D]``.
    """
    weight = layer.weight
    if not weight.requires_grad:
        return {}
    x = activations[0]
    with torch.no_grad():  # also keeps these two calls from being recorded by the hooks
        at_one = functional_call(layer, {"weight": torch.ones_like(weight)}, (x,))
        at_zero = functional_call(layer, {"weight": torch.zeros_like(weight)}, (x,))
    normalized = at_one - at_zero  # h(x), in the layer's output dtype
    return {weight: sum_to_param(backprops * normalized.to(backprops.dtype), weight, channel_dim=None)}


# ---------------------------------------------------------------------------------- ViT
@register_grad_sampler(VIT_EMBEDDINGS)
def vit_embeddings_grad_sample(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of ViTEmbeddings' own parameters (its patch projection has its own).

    The forward is ``dropout(cat([cls, patches * (1 - m) + mask_token * m]) + position_embeddings)``.

    Args:
        activations: ``[pixel_values, bool_masked_pos?, interpolate_pos_encoding?]``.
        backprops: G, ``[B, 1 + N, D]`` (N patches).

    Returns:
        cls_token, mask_token: ``[B, 1, 1, D]``; position_embeddings: ``[B, 1, 1 + N, D]``.
    """
    if layer.training and layer.dropout.p > 0:
        raise UnsupportedModuleError(
            f"ViTEmbeddings applies dropout (p={layer.dropout.p}) after adding its class token and "
            f"position embeddings, so their per-sample gradients would need the dropout mask. Build "
            f"the model with hidden_dropout_prob=0.0 (ViT's default), or freeze cls_token and "
            f"position_embeddings (requires_grad_(False))."
        )
    pixels = activations[0]
    masked = activations[1] if len(activations) > 1 else None
    interpolate = bool(activations[2]) if len(activations) > 2 else False
    same_grid = layer.position_embeddings.shape[1] == backprops.shape[1] and pixels.shape[-2] == pixels.shape[-1]
    if interpolate and not same_grid:  # the table is used as is otherwise (HF's own condition)
        raise UnsupportedModuleError(
            "ViTEmbeddings(interpolate_pos_encoding=True) resamples its position table to another "
            "image size; per-sample gradients through that interpolation are not supported. Train "
            "at the model's own image size (config.image_size)."
        )
    grads = {}
    if layer.cls_token.requires_grad:
        grads[layer.cls_token] = backprops[:, None, :1, :]
    if layer.position_embeddings.requires_grad:
        grads[layer.position_embeddings] = backprops.unsqueeze(1)
    mask_token = getattr(layer, "mask_token", None)
    if mask_token is not None and mask_token.requires_grad and masked is not None:
        weight = masked.to(backprops.dtype).unsqueeze(-1)  # [B, N, 1]
        grads[mask_token] = (backprops[:, 1:] * weight).sum(dim=1)[:, None, None, :]
    return grads


# ---------------------------------------------------------------------------------- scaled embeddings
def scaled_embedding_backprops(layer: nn.Embedding, backprops: Tensor) -> Tensor:
    """The gradient reaching the table of ``embedding(ids) * embed_scale``: ``G * embed_scale``.

    ``[B, *, D]`` -> ``[B, *, D]``, with the scale as the forward multiplies by it (a 0-d buffer cast
    to the weight's dtype, or a Python float), so the product is the one autograd forms.
    """
    scale = layer.embed_scale
    return backprops * (scale.to(layer.weight.dtype) if isinstance(scale, Tensor) else scale)


@register_grad_sampler(*SCALED_EMBEDDINGS)
def scaled_embedding_grad_sample(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients ``[B, V, D]`` of a scaled word embedding (ids ``[B, *]``, G ``[B, *, D]``)."""
    return embedding_grad_sample(layer, activations, scaled_embedding_backprops(layer, backprops))


@register_norm_sampler(*SCALED_EMBEDDINGS)
def scaled_embedding_norms(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    """``{weight: [B]}`` squared norms (upper bounds) of a scaled word embedding's gradients."""
    return embedding_norms(layer, activations, scaled_embedding_backprops(layer, backprops))


@register_clipped_sum(*SCALED_EMBEDDINGS)
def scaled_embedding_clipped_sum(
    layer: nn.Embedding, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``{weight: sum_i w_i grad_i}`` (``[V, D]``) of a scaled word embedding."""
    return embedding_clipped_sum(layer, activations, scaled_embedding_backprops(layer, backprops), weights)


def scaled_embedding_linear_cross_term(
    embedding: nn.Embedding, embedding_use: Use, head: nn.Linear, head_use: Use
) -> dict[nn.Parameter, Tensor]:
    """The cross term of an LM head tied to a scaled word embedding (Gemma ties them by default):
    the ``nn.Embedding`` rule on the scaled embedding gradient."""
    activations, backprops = embedding_use
    scaled = (activations, scaled_embedding_backprops(embedding, backprops))
    return embedding_linear_cross_term(embedding, scaled, head, head_use)


for _name in SCALED_EMBEDDINGS:
    register_cross_term(_name, nn.Linear)(scaled_embedding_linear_cross_term)
