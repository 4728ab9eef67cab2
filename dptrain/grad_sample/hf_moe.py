"""Mixture-of-experts layers of Hugging Face ``transformers`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
exact per-sample gradients and ghost norms of the router and of the fused experts.

Registered by qualified class name (see :mod:`~dptrain.grad_sample.registry`): transformers is
never imported here. Each family's sparse block (``*SparseMoeBlock``) reshapes the hidden states
``[B, T, H]`` to the flattened tokens ``[B * T, H]`` and runs its router, its experts (and
Qwen2-MoE's shared expert, plain ``nn.Linear`` layers) on those rows: the block is registered as
token-flattening, so each layer's tensors reach the rules below as ``[B, T, ...]``, row t of
sample b being flattened row ``b * T + t``.

- **The router** (``*TopKRouter``, weight ``W [E, H]``) returns ``(logits, top-k weights, top-k
  indices)``: the logits are ``x W^T`` and the top-k weights a per-token function of that tensor
  (softmax, top-k, optional renormalisation). Its output-gradient rule
  (:func:`router_output_gradient`) takes the logits' gradient, which already includes the paths
  through the top-k weights, as ``G [B, T, E]``: the router is then a Linear over tokens, with
  per-sample gradient ``G_b^T X_b`` and the Linear ghost norm, clipped sum and cost rule.
- **The experts** (``*Experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; forward
  ``out_t = sum_j w_tj W_down[e_tj] act_gate(W_gu[e_tj] x_t)`` over the token's k chosen experts,
  whichever of transformers' kernels runs it: eager loop, ``batched_mm`` or ``grouped_mm``). Each
  (token, chosen expert) pair is a *slot* (S = T k per sample). Per slot s of expert e:
  ``u_s = W_gu[e] x_s``, ``a_s = act_gate(u_s)``, the down projection's output gradient
  ``d_s = w_s g_t`` and the gate-up output gradient ``c_s`` = the gate's VJP of ``W_down[e]^T d_s``
  (:func:`expert_slots`, recomputed from the recorded inputs; the gate's own function
  ``layer._apply_gate`` is differentiated, so a family's own gating is respected). Sample b's
  gradients are sums of outer products over its slots routed to each expert:
  ``grad_b(W_down[e]) = sum_{s in b, e_s = e} d_s a_s^T`` and ``grad_b(W_gu[e]) = sum c_s x_s^T``.
  That is a Linear from the one-hot expanded input ``onehot(e_s) (x) a_s`` (width E I), whose Gram
  is the slots' Gram masked to pairs routed to the same expert: ``||grad_b||^2 = sum_{s, s' in b}
  [e_s = e_s'] (a_s . a_s') (d_s . d_s')``, computed with the round-off bounds of the Linear ghost
  norm (:mod:`~dptrain.grad_sample.ghost_math`; a masked entry is exact). The clipped sum is one
  matrix product per expert over the rows routed to it, each reweighted by its sample's factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost_linear import linear_merge_uses, linear_prefers_ghost
from dptrain.grad_sample.ghost_math import (
    GramSource,
    as_sequence,
    chunked_outer_gram_pair,
    ghost_cost_ratio,
    ghost_sq_norms,
    gram_dtype,
    norm_dtype,
    outer_gram_pair,
    rounded_up,
    tightened_gram_bounds,
    weighted_outer_sum,
)
from dptrain.grad_sample.ghost_registry import (
    Weights,
    register_clipped_sum,
    register_ghost_cost,
    register_use_merger,
)
from dptrain.grad_sample.registry import (
    register_grad_sampler,
    register_norm_sampler,
    register_output_gradient,
    register_token_flattening,
)

# (module, class prefix) of each family; every class checked against the installed transformers'
# source (tests/grad_sample/test_hf_moe.py runs each family that exists).
FAMILIES: tuple[tuple[str, str], ...] = (
    ("mixtral", "Mixtral"),
    ("qwen2_moe", "Qwen2Moe"),
    ("qwen3_moe", "Qwen3Moe"),
    ("olmoe", "Olmoe"),
)


def _classes(suffix: str) -> tuple[str, ...]:
    return tuple(f"transformers.models.{m}.modeling_{m}.{prefix}{suffix}" for m, prefix in FAMILIES)


MOE_BLOCKS = _classes("SparseMoeBlock")
ROUTERS = _classes("TopKRouter")
EXPERTS = _classes("Experts")

register_token_flattening(*MOE_BLOCKS)


# ---------------------------------------------------------------------------------- router
class _LinearCalls(TorchFunctionMode):
    """Records ``(input, output)`` of every ``F.linear`` whose weight is ``weight``."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.calls: list[tuple[Tensor, Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if func is F.linear and weight is self.weight:
            self.calls.append((args[0] if args else kwargs["input"], out))
        return out


@register_output_gradient(*ROUTERS)
def router_output_gradient(
    layer: nn.Module, activations: list[Any], grads: tuple[Tensor, ...]
) -> tuple[list[Tensor], Tensor]:
    """The router's use as a Linear over tokens: ``([X [B, T, H]], G [B, T, E])``.

    Args:
        activations: ``[hidden_states]``, ``[B, T, H]`` (the flattened tokens given back the batch).
        grads: the gradients of its differentiable outputs (router logits ``[B, T, E]``, top-k
            weights ``[B, T, k]``), batch first, as their tensor hooks received them.

    The logits are the product ``x W^T`` itself, and the top-k weights are computed from that very
    tensor, so the gradient its hook received is already the product's whole gradient (the paths
    through the top-k weights included; adding the top-k weights' gradient again would count them
    twice). Which output is the product is checked, not assumed: the forward is re-run (without
    hooks, no gradient) on the recorded input with the weight's ``F.linear`` recorded
    (:class:`_LinearCalls`), and exactly one call must be one of the outputs.
    """
    x = activations[0]
    recorder = _LinearCalls(layer.weight)
    with torch.no_grad(), recorder:
        outputs = layer.forward(x)
    floating = [o for o in tree_leaves(outputs) if isinstance(o, Tensor) and o.is_floating_point()]
    product = [i for i, o in enumerate(floating) for _, out in recorder.calls if o is out]
    if len(recorder.calls) != 1 or len(product) != 1 or len(floating) != len(grads):
        raise UnsupportedModuleError(
            f"{type(layer).__name__}: its forward used its weight in {len(recorder.calls)} F.linear "
            f"calls and returned {len(floating)} floating outputs ({len(grads)} expected), "
            f"{'one' if len(product) == 1 else 'none'} of them the product x W^T, so it is not one "
            f"Linear over the tokens returning its logits, which its per-sample rule assumes (the "
            f"router of this transformers version differs from the one it was written for). Freeze "
            f"the router (requires_grad_(False) on its weight)."
        )
    (inputs, _), = recorder.calls
    leading = x.shape[:-1]
    g = grads[product[0]]
    return [inputs.reshape(*leading, inputs.shape[-1])], g.reshape(*leading, g.shape[-1])


@register_grad_sampler(*ROUTERS)
def router_grad_sample(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradient of the router's weight ``[E, H]``: ``G_b^T X_b``, ``[B, E, H]``."""
    if not layer.weight.requires_grad:
        return {}
    a, g = as_sequence(activations[0]), as_sequence(backprops)
    return {layer.weight: g.transpose(1, 2) @ a.to(g.dtype)}


@register_norm_sampler(*ROUTERS)
def router_norms(layer: nn.Module, activations: list[Tensor], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Upper bounds of the router weight's per-sample squared norms ``[B]`` (the Linear ghost norm)."""
    if not layer.weight.requires_grad:
        return {}
    return {layer.weight: ghost_sq_norms(as_sequence(activations[0]), as_sequence(backprops))}


@register_clipped_sum(*ROUTERS)
def router_clipped_sum(
    layer: nn.Module, activations: list[Tensor], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``sum_i w_i G_i^T X_i`` ``[E, H]``, one matmul."""
    if layer.weight not in weights:
        return {}
    a, g = as_sequence(activations[0]), as_sequence(backprops)
    return {layer.weight: weighted_outer_sum(a, g, weights[layer.weight])}


register_ghost_cost(*ROUTERS)(linear_prefers_ghost)
register_use_merger(*ROUTERS)(linear_merge_uses)


# ---------------------------------------------------------------------------------- experts
@dataclass
class ExpertSlots:
    """The (token, chosen expert) slots of one experts call, S = T k per sample, in token order.

    Attributes:
        expert: ``[B, S]`` the expert of each slot.
        hidden: ``[B, S, H]`` its input (the token's hidden state), the gate-up projection's A.
        gate_up_grad: ``[B, S, 2I]`` the gradient w.r.t. the gate-up projection's output (its G).
        inner: ``[B, S, I]`` ``act_gate(u)``, the down projection's A.
        down_grad: ``[B, S, H]`` ``w * g``, the gradient w.r.t. the down projection's output (its G).
    """

    expert: Tensor
    hidden: Tensor
    gate_up_grad: Tensor
    inner: Tensor
    down_grad: Tensor


def _check_supported(layer: nn.Module) -> None:
    """Refuse an experts module in a layout the rules do not cover (biases, transposed weights,
    no gate, a norm after each expert)."""
    flags = {
        "has_gate": getattr(layer, "has_gate", True),
        "has_bias": getattr(layer, "has_bias", False),
        "is_transposed": getattr(layer, "is_transposed", False),
        "has_post_expert_norm": getattr(layer, "has_post_expert_norm", False),
    }
    if flags != {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}:
        raise UnsupportedModuleError(
            f"{type(layer).__name__} has {flags}; dptrain's per-sample rule covers fused experts with "
            f"a concatenated gate-up projection [E, 2I, H], a down projection [E, H, I], no biases "
            f"and no norm after each expert (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE). Freeze the "
            f"experts (requires_grad_(False)) and train the other layers or LoRA adapters."
        )


@dataclass(frozen=True)
class ExpertOrder:
    """The rows of a call sorted by expert: ``perm`` (a stable sort of the 1-D expert ids) and
    ``blocks``, ``(e, start, stop)`` of each expert some row is routed to, in ``perm``'s order:
    each expert's rows are then one contiguous slice (one gather in, no scatter per expert)."""

    perm: Tensor
    blocks: list[tuple[int, int, int]]

    @classmethod
    def of(cls, expert: Tensor, count: int) -> "ExpertOrder":
        perm = torch.argsort(expert, stable=True)
        blocks, start = [], 0
        for e, n in enumerate(torch.bincount(expert, minlength=count).tolist()):
            if n:
                blocks.append((e, start, start + n))
            start += n
        return cls(perm, blocks)

    def restored(self, sorted_rows: Tensor) -> Tensor:
        """Rows in ``perm``'s order put back in the original order."""
        out = torch.empty_like(sorted_rows)
        out[self.perm] = sorted_rows
        return out


def expert_slots(layer: nn.Module, activations: list[Any], backprops: Tensor) -> ExpertSlots:
    """Recompute the slots' operands of an experts call (see the module docstring).

    Args:
        activations: ``[hidden_states [B, T, H], top_k_index [B, T, k], top_k_weights [B, T, k]]``.
        backprops: ``[B, T, H]``, the gradient w.r.t. the experts' output.
    """
    _check_supported(layer)
    x, index, route = activations[0], activations[1], activations[2]
    batch, k = x.shape[0], index.shape[-1]
    hidden = as_sequence(x).repeat_interleave(k, dim=1)  # slot t k + j is token t's j-th choice
    expert = index.reshape(batch, -1)
    down_grad = as_sequence(backprops).repeat_interleave(k, dim=1) * route.reshape(batch, -1, 1)
    gate_up, down = layer.gate_up_proj.detach(), layer.down_proj.detach()
    order = ExpertOrder.of(expert.reshape(-1), gate_up.shape[0])
    rows_h = hidden.reshape(-1, hidden.shape[-1])[order.perm].to(gate_up.dtype)
    rows_d = down_grad.reshape(-1, down_grad.shape[-1])[order.perm].to(down.dtype)
    up = rows_h.new_empty(rows_h.shape[0], gate_up.shape[1])
    for e, start, stop in order.blocks:
        torch.mm(rows_h[start:stop], gate_up[e].t(), out=up[start:stop])
    with torch.enable_grad():
        up.requires_grad_(True)
        inner = layer._apply_gate(up)
        inner_grad = inner.new_empty(inner.shape)
        for e, start, stop in order.blocks:
            torch.mm(rows_d[start:stop], down[e], out=inner_grad[start:stop])
        (up_grad,) = torch.autograd.grad(inner, up, inner_grad)
    slots = expert.shape[1]
    return ExpertSlots(
        expert=expert,
        hidden=hidden,
        gate_up_grad=order.restored(up_grad).view(batch, slots, -1),
        inner=order.restored(inner.detach()).view(batch, slots, -1),
        down_grad=down_grad,
    )


def _operands(layer: nn.Module, slots: ExpertSlots) -> list[tuple[nn.Parameter, Tensor, Tensor]]:
    """``(param, A [B, S, d], G [B, S, p])`` of each trainable expert weight."""
    pairs = [(layer.gate_up_proj, slots.hidden, slots.gate_up_grad), (layer.down_proj, slots.inner, slots.down_grad)]
    return [(p, a, g) for p, a, g in pairs if p.requires_grad]


def per_expert_outer_grads(a: Tensor, g: Tensor, expert: Tensor, experts: int) -> Tensor:
    """Per-sample gradients ``[B, E, p, d]``: entry ``[b, e]`` is ``sum_{s in b, e_s = e} g_s a_s^T``.

    One batched matmul per expert some slot is routed to, over the samples, the other slots masked
    (E times the multiply-adds of the outer products: what forming ``[B, E, p, d]`` costs anyway).
    """
    dtype = torch.promote_types(a.dtype, g.dtype)
    out = g.new_zeros(g.shape[0], experts, g.shape[2], a.shape[2], dtype=dtype)
    a = a.to(dtype)
    for e in expert.unique().tolist():
        mask = (expert == e).unsqueeze(-1).to(dtype)
        out[:, e] = (g.to(dtype) * mask).transpose(1, 2) @ a
    return out


def _same_expert(source: GramSource, same: Tensor) -> GramSource:
    """``source`` with A's Gram masked to the slot pairs routed to the same expert (``same``
    ``[B, S, S]``): the Gram of the one-hot expanded input, each kept entry computed as before and
    the others exactly 0, so the entries' error bounds still hold."""

    def grams(dtype: torch.dtype, rows: Optional[Tensor]) -> tuple[Tensor, Tensor, float, float]:
        gram_a, gram_g, gamma_a, gamma_g = source(dtype, rows)
        mask = same if rows is None else same[rows]
        return torch.where(mask, gram_a, torch.zeros((), dtype=gram_a.dtype)), gram_g, gamma_a, gamma_g

    return grams


def per_expert_sq_norms(a: Tensor, g: Tensor, expert: Tensor) -> Tensor:
    """Upper bounds of ``sum_e ||sum_{s in b, e_s = e} g_s a_s^T||^2`` ``[B]`` (norm dtype) by the
    masked Gram identity, with the Linear ghost norm's round-off bounds and recomputations."""
    same = expert.unsqueeze(2) == expert.unsqueeze(1)
    chunked = chunked_outer_gram_pair(a, g)
    bounds = tightened_gram_bounds(
        _same_expert(outer_gram_pair(a, g), same),
        gram_dtype(g),
        a.shape[0],
        None if chunked is None else _same_expert(chunked, same),
    )
    return rounded_up(bounds, norm_dtype(g))


def per_expert_weighted_sum(a: Tensor, g: Tensor, expert: Tensor, weights: Tensor, experts: int) -> Tensor:
    """``sum_b w_b grad_b`` ``[E, p, d]`` (norm dtype): per expert, one matmul over the rows routed
    to it, each row's G scaled by its sample's weight."""
    dtype = norm_dtype(g)
    order = ExpertOrder.of(expert.reshape(-1), experts)
    rows_g = (g.to(dtype) * weights.to(dtype).view(-1, 1, 1)).reshape(-1, g.shape[2])[order.perm]
    rows_a = a.to(dtype).reshape(-1, a.shape[2])[order.perm]
    out = rows_g.new_zeros(experts, g.shape[2], a.shape[2])
    for e, start, stop in order.blocks:
        torch.mm(rows_g[start:stop].t(), rows_a[start:stop], out=out[e])
    return out


@register_grad_sampler(*EXPERTS)
def experts_grad_sample(layer: nn.Module, activations: list[Any], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Per-sample gradients of the fused experts: gate_up_proj ``[B, E, 2I, H]``, down_proj
    ``[B, E, H, I]``."""
    slots = expert_slots(layer, activations, backprops)
    experts = layer.gate_up_proj.shape[0]
    return {p: per_expert_outer_grads(a, g, slots.expert, experts) for p, a, g in _operands(layer, slots)}


@register_norm_sampler(*EXPERTS)
def experts_norms(layer: nn.Module, activations: list[Any], backprops: Tensor) -> dict[nn.Parameter, Tensor]:
    """Upper bounds of the fused experts' per-sample squared norms ``[B]`` (masked Gram identity)."""
    slots = expert_slots(layer, activations, backprops)
    return {p: per_expert_sq_norms(a, g, slots.expert) for p, a, g in _operands(layer, slots)}


@register_clipped_sum(*EXPERTS)
def experts_clipped_sum(
    layer: nn.Module, activations: list[Any], backprops: Tensor, weights: Weights
) -> dict[nn.Parameter, Tensor]:
    """``sum_i w_i grad_i`` of gate_up_proj ``[E, 2I, H]`` and down_proj ``[E, H, I]``."""
    slots = expert_slots(layer, activations, backprops)
    experts = layer.gate_up_proj.shape[0]
    return {
        p: per_expert_weighted_sum(a, g, slots.expert, weights[p], experts)
        for p, a, g in _operands(layer, slots)
        if p in weights
    }


@register_ghost_cost(*EXPERTS)
def experts_prefer_ghost(layer: nn.Module, activations: list[Any], backprops: Tensor) -> bool:
    """Ghost when the masked Grams (``S^2 (d + p)`` per weight, S = T k slots, times the device's
    :func:`~dptrain.grad_sample.ghost_math.ghost_cost_ratio`) cost no more than forming the
    per-sample gradients (``E S p d``, :func:`per_expert_outer_grads`) and the Grams ``S^2`` take no
    more memory than the gradients ``E p d`` per sample."""
    experts, two_inner, width = layer.gate_up_proj.shape
    inner = layer.down_proj.shape[2]
    slots = activations[1][0].numel() if activations[1].shape[0] else 0
    ghost = ghost_cost_ratio(backprops) * slots * slots * (width + two_inner + inner + width)
    weights = two_inner * width + width * inner
    return ghost <= experts * slots * weights and 2 * slots * slots <= experts * weights
