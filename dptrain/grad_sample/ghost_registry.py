"""Per-layer rules of ghost clipping: how to form a layer's clipped sum without per-sample grads.

A norm sampler (``dptrain.register_norm_sampler``) gives a layer's per-sample squared norms. To
finish book-keeping, the ghost module also needs the clipped sum ``sum_i w_i grad_i`` from the
stored activations and backprops, and a way to decide, per call, whether the ghost path is
cheaper than instantiating the per-sample gradient. Those live here::

    @register_clipped_sum(nn.Linear)
    def linear_clipped_sum(layer, activations, backprops, weights) -> dict[nn.Parameter, Tensor]:
        ...  # weights[p]: Tensor[B]; each value has p's shape

    @register_ghost_cost(nn.Linear)
    def linear_prefers_ghost(layer, activations, backprops) -> bool: ...

    @register_use_merger(nn.Linear)
    def merge(layer, uses: list[tuple[list[Tensor], Tensor]]) -> tuple[list[Tensor], Tensor]: ...

A *use compactor* (``register_use_compactor``, ``fn(layer, activations, backprops) -> (activations,
backprops)``) gives an equivalent, smaller form of one use, which the ghost module keeps instead
(an Embedding under a pooling layer: its ``[B, T, D]`` output gradient, equal at every position,
becomes a broadcast view of ``[B, 1, D]``); the layer's norm sampler and clipped sum accept both.

An *instantiator* (``register_instantiator``, same signature as a grad sampler) replaces the grad
sampler when the ghost module instantiates a layer and a faster kernel exists (convolutions: one
grouped convolution over the batch instead of unfolding).

A *row grouper* (``register_row_grouper``, same signature as a use merger) folds uses that hold
different rows of the same group (the examples of one user, each use one example per user) into
one use whose row is the group: user-level ghost clipping
(:mod:`~dptrain.grad_sample.ghost_groups`) takes a layer's row grouper, else its use merger (a
layer whose gradient is a sum over positions folds both the same way), else instantiates it.

A *cross-term rule* (``register_cross_term(TypeA, TypeB)``) serves two layers that share a
parameter (tied weights): ``fn(layer_a, use_a, layer_b, use_b) -> {param: Tensor[B]}`` gives, per
shared parameter, each sample's inner product ``<grad_i(a), grad_i(b)>`` of the two layers'
per-sample gradients, so that the squared norm of their sum needs neither.

A layer takes the ghost path when it has a norm sampler AND a clipped sum, and its cost rule (if
any) says so; otherwise its per-sample gradients are instantiated by its grad sampler. A layer
called several times in one backward (weight sharing, recurrent cells) takes the ghost path only
if a use merger can fold the uses into one call (for outer-product layers: concatenating the
positions); else the uses' instantiated gradients are summed. Lookup walks the MRO; the last
registration for a type wins.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

from dptrain.grad_sample.registry import LayerKey, _check_types, _lookup, _register, qualified_name

Weights = dict[nn.Parameter, Tensor]
ClippedSum = Callable[[nn.Module, list[Tensor], Tensor, Weights], dict[nn.Parameter, Tensor]]
GhostCost = Callable[[nn.Module, list[Tensor], Tensor], bool]
Use = tuple[list[Tensor], Tensor]
UseMerger = Callable[[nn.Module, list[Use]], Use]
CrossTerm = Callable[[nn.Module, Use, nn.Module, Use], dict[nn.Parameter, Tensor]]

Instantiator = Callable[[nn.Module, list[Tensor], Tensor], dict[nn.Parameter, Tensor]]
UseCompactor = Callable[[nn.Module, list[Tensor], Tensor], Use]

CLIPPED_SUMS: dict[LayerKey, ClippedSum] = {}
INSTANTIATORS: dict[LayerKey, Instantiator] = {}
GHOST_COSTS: dict[LayerKey, GhostCost] = {}
USE_MERGERS: dict[LayerKey, UseMerger] = {}
USE_COMPACTORS: dict[LayerKey, UseCompactor] = {}
ROW_GROUPERS: dict[LayerKey, UseMerger] = {}
CROSS_TERMS: dict[tuple[LayerKey, LayerKey], CrossTerm] = {}


def register_clipped_sum(*types: LayerKey) -> Callable[[ClippedSum], ClippedSum]:
    """Register ``fn(layer, activations, backprops, weights) -> {param: sum_i w_i grad_i}``."""
    return _register(CLIPPED_SUMS, "register_clipped_sum", types)


def register_instantiator(*types: LayerKey) -> Callable[[Instantiator], Instantiator]:
    """Register a faster way than the grad sampler to form per-sample grads (same signature)."""
    return _register(INSTANTIATORS, "register_instantiator", types)


def register_ghost_cost(*types: LayerKey) -> Callable[[GhostCost], GhostCost]:
    """Register ``fn(layer, activations, backprops) -> bool``: True when ghost is cheaper."""
    return _register(GHOST_COSTS, "register_ghost_cost", types)


def register_use_merger(*types: LayerKey) -> Callable[[UseMerger], UseMerger]:
    """Register ``fn(layer, uses) -> (activations, backprops)`` folding one backward's uses."""
    return _register(USE_MERGERS, "register_use_merger", types)


def register_row_grouper(*types: LayerKey) -> Callable[[UseMerger], UseMerger]:
    """Register ``fn(layer, uses) -> (activations, backprops)`` folding uses that hold different
    rows of the same groups into one use with a row per group (see the module docstring)."""
    return _register(ROW_GROUPERS, "register_row_grouper", types)


def register_use_compactor(*types: LayerKey) -> Callable[[UseCompactor], UseCompactor]:
    """Register ``fn(layer, activations, backprops) -> (activations, backprops)``: a smaller,
    equivalent form of one use for the ghost module to keep (see the module docstring)."""
    return _register(USE_COMPACTORS, "register_use_compactor", types)


def register_cross_term(first: LayerKey, second: LayerKey) -> Callable[[CrossTerm], CrossTerm]:
    """Register ``fn(layer_a, use_a, layer_b, use_b) -> {shared param: Tensor[B]}`` for a layer of
    type ``first`` tied to one of type ``second`` (either order is found by the lookup)."""
    _check_types("register_cross_term", (first, second))

    def wrap(fn: CrossTerm) -> CrossTerm:
        CROSS_TERMS[(first, second)] = fn
        return fn

    return wrap


def _of(layer: nn.Module) -> type:
    return type(layer)


def get_clipped_sum(layer: nn.Module) -> Optional[ClippedSum]:
    """The clipped-sum rule of ``layer``'s type (MRO walk), or None."""
    return _lookup(CLIPPED_SUMS, _of(layer))


def get_ghost_cost(layer: nn.Module) -> Optional[GhostCost]:
    """The ghost-vs-instantiate cost rule of ``layer``'s type (MRO walk), or None."""
    return _lookup(GHOST_COSTS, _of(layer))


def get_instantiator(layer: nn.Module) -> Optional[Instantiator]:
    """The ghost module's instantiator for ``layer`` (MRO walk), or None (use the grad sampler)."""
    return _lookup(INSTANTIATORS, _of(layer))


def get_use_merger(layer: nn.Module) -> Optional[UseMerger]:
    """The rule folding several uses of ``layer`` in one backward into one, or None."""
    return _lookup(USE_MERGERS, _of(layer))


def get_row_grouper(layer: nn.Module) -> Optional[UseMerger]:
    """The rule folding rows of the same group into one (a row grouper, else the use merger), or
    None: the layer's gradient is not a sum over positions that concatenation preserves."""
    return _lookup(ROW_GROUPERS, _of(layer)) or get_use_merger(layer)


def get_use_compactor(layer: nn.Module) -> Optional[UseCompactor]:
    """The rule giving a smaller form of one use of ``layer``, or None (keep it as captured)."""
    return _lookup(USE_COMPACTORS, _of(layer))


def _pair_rule(first: type, second: type) -> Optional[CrossTerm]:
    """The cross-term rule registered for (a class of ``first``'s MRO, one of ``second``'s)."""
    for a in first.__mro__:
        for b in second.__mro__:
            for key in ((a, b), (qualified_name(a), qualified_name(b)), (a, qualified_name(b)), (qualified_name(a), b)):
                if key in CROSS_TERMS:
                    return CROSS_TERMS[key]
    return None


def get_cross_term(first: nn.Module, second: nn.Module) -> Optional[Callable[[Use, Use], dict[nn.Parameter, Tensor]]]:
    """``fn(use_first, use_second) -> {shared param: Tensor[B]}`` for two tied layers, or None."""
    rule = _pair_rule(type(first), type(second))
    if rule is not None:
        return lambda use_a, use_b: rule(first, use_a, second, use_b)
    rule = _pair_rule(type(second), type(first))
    if rule is not None:
        return lambda use_a, use_b: rule(second, use_b, first, use_a)
    return None
