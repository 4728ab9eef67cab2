"""GhostClippingModule: DP clipping in one backward pass without per-sample gradients.

The module reuses :class:`~dptrain.grad_sample.module.GradSampleModule`'s capture (forward hooks
store each layer call's inputs A, tensor hooks hand over the output gradients G, uses within a block
of examples sum and blocks concatenate, see :mod:`~dptrain.grad_sample.accumulate`) and replaces what
happens per layer on backward:

- *ghost* layers (a norm sampler exists, the cost rule says ghost is cheaper for these shapes,
  see :mod:`~dptrain.grad_sample.ghost_math`) keep A and G; their per-sample squared norms come
  from the norm sampler and their clipped sum ``sum_i c_i grad_i`` is one weighted matmul/kernel
  call (book-keeping, Bu et al. 2023), or, for a layer with a norm sampler but no clipped-sum rule
  (a user's own layer), one reweighted backward of that layer (:mod:`~dptrain.grad_sample.ghost_vjp`);
- *instantiate* layers (normalisation layers, convolutions with many positions, layers without a
  norm sampler, layers sharing a parameter with another layer that has no cross-term rule) get
  their per-sample gradients from their grad sampler at once (G is freed) and the clipped sum is a
  weighted sum of those.

Layers sharing a parameter (tied weights: an LM head tied to the input embedding) contribute
``E_i + H_i`` to sample i's gradient of that parameter, whose squared norm is
``||E_i||^2 + ||H_i||^2 + 2 <E_i, H_i>``. When a cross-term rule is registered for the pair of layer
types (``ghost_registry.register_cross_term``; Embedding and Linear have one, computed from the
token ids, the head's inputs and both output gradients, never a ``[B, V, D]`` tensor), both layers
take the ghost path and the cross term is added to the norms; otherwise both are instantiated.
In one block of examples a tied parameter is never split between the two paths.

A layer called several times in one block (weight sharing, recurrent cells, or the forward passes
of one backward: two views of the same examples) contributes the SUM of
its uses to each sample's gradient, whose norm has cross terms between the uses: its uses are
either all kept for one ghost norm (folded by a use merger) or all instantiated and summed before
the norm is taken, never split between the two.

The choice is made per layer from the actual shapes, logged once per layer (logger
``dptrain.grad_sample.ghost``) and exposed by :meth:`GhostClippingModule.layer_strategies`.

Autograd never computes the non-private parameter gradients that clipping would throw away: while
a hooked layer runs its forward, its parameters are made not to require grad (restored right after,
even on error); when nothing else in the call requires grad (a first layer), its output is attached
to the graph through a zero-cost autograd node so that its gradient still flows to the hooks.
Consequently ``p.grad`` stays ``None`` after backward and ``p.grad_sample`` is never set: the DP
optimizer uses only the clipping interface (``squared_norms``, ``weighted_sum``...) and writes
``p.grad`` itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from dptrain.errors import ConfigError, UnsupportedModuleError
from dptrain.grad_sample import ghost_conv, ghost_embedding, ghost_linear, ghost_normalization  # noqa: F401
from dptrain.grad_sample.ghost_math import (
    dropped_samples,
    norm_dtype,
    sq_norms,
    summed_upper_bound,
    weighted_sample_sum,
    without_rows,
)
from dptrain.grad_sample.ghost_registry import (
    Use,
    get_clipped_sum,
    get_cross_term,
    get_ghost_cost,
    get_instantiator,
    get_use_compactor,
    get_use_merger,
)
from dptrain.grad_sample.ghost_vjp import vjp_clipped_sums
from dptrain.grad_sample.module import LOSS_REDUCTIONS, GradSampleModule, LayerCall, _trainable_direct, bookkeeping
from dptrain.grad_sample.registry import get_grad_sampler, get_norm_sampler, get_output_gradient

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "ghost", "instantiate")
GHOST, INSTANTIATE = "ghost", "instantiate"


class _AttachToGraph(torch.autograd.Function):
    """Identity on ``output`` that makes it require grad through a dummy leaf (no copy).

    ``output`` is marked dirty, so it stays an ordinary (non-view) tensor on which later in-place
    operations (``ReLU(inplace=True)``) are allowed; its gradient passes through unchanged.
    """

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, output: Tensor) -> Tensor:
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, grad


class _AttachInput(torch.autograd.Function):
    """Identity on ``x`` (a view) that requires grad through a dummy leaf: a layer's input attached
    before its forward, so that outputs computed from one another stay linked in the graph."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, grad


@dataclass
class _GhostEntry:
    """What one ghost layer left from one block of examples (the passes of one backward).

    Attributes:
        call: a copy of the layer's first recorded call in the block, inputs included (the base
            class drops the original's inputs once dispatched); they serve a re-run of the layer
            (:meth:`GhostClippingModule._entry_sums`, the fallback of ``_instantiate_uses``).
        uses: ``(activations, backprops)`` per call in the block (merged lazily into one).
        norms: cached ``{param: Tensor[B_block]}`` (cleared when a use is added).
        released: whether :meth:`release` dropped the inputs and uses (the clipped sum is formed).
    """

    call: LayerCall
    uses: list[Use] = field(default_factory=list)
    norms: Optional[dict[nn.Parameter, Tensor]] = None
    released: bool = False

    def release(self) -> None:
        """Drop the stored A and G (the uses and the recorded call's inputs); the norms stay."""
        self.uses.clear()
        # in place: `call` is this entry's own copy of the recorded call (see _on_backprop)
        self.call.args, self.call.kwargs, self.call.grads = (), {}, []
        self.released = True

    @property
    def layer(self) -> nn.Module:
        return self.call.layer

    @property
    def name(self) -> str:
        return self.call.name


class GhostClippingModule(GradSampleModule):
    """A GradSampleModule whose clipping interface is served by ghost norms + book-keeping.

    Args:
        model, batch_first, loss_reduction: as :class:`GradSampleModule`.
        strategy: ``"auto"`` (per layer, cheaper of ghost and instantiate), ``"ghost"`` (ghost
            wherever a layer has the rules) or ``"instantiate"`` (always form per-sample grads;
            for comparisons).
    """

    def __init__(
        self,
        model: nn.Module,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strategy: str = "auto",
    ) -> None:
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"GhostClippingModule(strategy={strategy!r}) is not supported: use 'auto' (choose per "
                f"layer from the shapes), 'ghost' or 'instantiate'."
            )
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(
                f"GhostClippingModule(loss_reduction={loss_reduction!r}) is not supported: use 'mean' "
                f"if your loss averages over the batch (torch's default) or 'sum' if it sums."
            )
        # The base scales every backprop by B for a mean loss; the per-sample quantities here are
        # linear (sums) or quadratic (norms) in the backprops, so the factor is applied to those
        # [B]-sized results instead (see _block_scale), sparing one pass over every layer's G.
        super().__init__(model, batch_first=batch_first, loss_reduction="sum")
        self.mean_loss = loss_reduction == "mean"
        self.strategy = strategy
        self._ghost: dict[tuple[int, int], _GhostEntry] = {}
        self._instantiated: dict[int, dict[nn.Parameter, Tensor]] = {}
        self._instantiated_uses: set[tuple[int, int]] = set()  # (block, layer id) instantiated
        self._block_sizes: dict[int, int] = {}
        self._strategies: dict[str, str] = {}
        self._reported: dict[str, str] = {}  # the choices last summed up in the log
        self._tied = tied_layers(model)
        self._frozen_by_us: dict[int, list[nn.Parameter]] = {}
        self._grad_before: dict[int, Optional[tuple[int, int]]] = {}
        self._anchor = torch.zeros((), requires_grad=True)
        self._add_grad_skipping_hooks()

    # ------------------------------------------------------------------ skipping p.grad
    def _add_grad_skipping_hooks(self) -> None:
        """Pre-hook: params stop requiring grad; hook (runs first, always): restore + attach."""
        for _, layer in self._module.named_modules():
            if next(layer.parameters(recurse=False), None) is None:
                continue
            self._handles.append(layer.register_forward_pre_hook(self._freeze_params))
            self._handles.append(
                layer.register_forward_hook(self._restore_params, prepend=True, always_call=True)
            )

    def _freeze_params(self, layer: nn.Module, args: tuple) -> Optional[tuple]:
        """Make the layer's trainable own params not require grad for this forward call.

        A layer with an output-gradient rule (several outputs, some computed from others: a
        router's top-k weights from its logits) whose inputs do not require grad gets its first
        input attached to the graph instead of its outputs afterwards (returned as the new
        arguments): outputs attached one by one would lose the links between them, and the
        gradient its rule reads would miss the paths through the others."""
        with bookkeeping():
            if not self._capturing(layer) or id(layer) in self._frozen_by_us:
                return None
            params = _trainable_direct(layer)
            for p in params:
                if id(p) not in self._grad_before:  # its state at its first captured forward
                    self._grad_before[id(p)] = _grad_state(p)
                p.requires_grad_(False)
            self._frozen_by_us[id(layer)] = params
            floating = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
            # the registry's lookup last: an input that requires grad settles it (every call of
            # a recurrent layer's pieces but the first)
            if not floating or any(a.requires_grad for a in floating) or get_output_gradient(layer) is None:
                return None
            first = next(i for i, a in enumerate(args) if a is floating[0])
        attached = _AttachInput.apply(self._anchor, args[first])  # tracked: the pass's provenance
        return (*args[:first], attached, *args[first + 1 :])

    def _restore_params(self, layer: nn.Module, args: tuple, output: Any) -> None:
        """Restore requires_grad; attach outputs to the graph when nothing else did (in place:
        each output stays the same tensor, provenance mark included)."""
        with bookkeeping():
            params = self._frozen_by_us.pop(id(layer), None)
            if params is None:
                return
            for p in params:
                p.requires_grad_(True)
            for out in tree_leaves(output):
                if isinstance(out, Tensor) and out.is_floating_point() and not out.requires_grad:
                    _AttachToGraph.apply(self._anchor, out)

    # ------------------------------------------------------------------ per-layer work
    def _on_backprop(self, call: LayerCall, activations: list[Any], backprops: Tensor | tuple[Tensor, ...]) -> None:
        """Keep A and G (ghost) or instantiate the per-sample gradients now (instantiate).

        All uses of a layer in one block take the same path (see the module docstring): a use
        after an instantiated one is instantiated, and a use that cannot be merged into a ghost
        entry instantiates that entry's uses too.
        """
        self._block_sizes.setdefault(call.rows_id, call.batch_size)  # also the mean's factor
        if call.batch_size == 0:
            return  # an empty (Poisson) batch: no sample, nothing to clip
        key = (call.rows_id, id(call.layer))
        entry = self._ghost.get(key)
        if entry is not None and get_use_merger(call.layer) is None:
            self._instantiate_uses(call, self._ghost.pop(key))  # a second use that cannot merge
            entry = None
        elif entry is None and key not in self._instantiated_uses:  # the block's first use decides
            if self._choose(call, activations, backprops) == GHOST:
                entry = self._ghost[key] = _GhostEntry(replace(call))  # a copy: keeps the inputs
        if entry is not None:
            compact = get_use_compactor(call.layer)
            use = (list(activations), backprops) if compact is None else compact(call.layer, list(activations), backprops)
            entry.uses.append(use)
            entry.norms = None
        else:
            self._instantiated_uses.add(key)
            self._add_grads(call.rows_id, self._instantiate(call, activations, backprops))

    def _instantiate(self, call: LayerCall, activations: list[Any], backprops: Tensor | tuple) -> dict[nn.Parameter, Tensor]:
        """Per-sample gradients of one call: the layer's instantiator if any, else its grad sampler."""
        instantiator = get_instantiator(call.layer)
        if instantiator is None or not isinstance(backprops, Tensor):
            return self._per_sample_grads(call, activations, backprops)
        return _trainable_only(call.layer, instantiator(call.layer, activations, backprops))

    def _choose(self, call: LayerCall, activations: list[Any], backprops: Tensor | tuple) -> str:
        """GHOST or INSTANTIATE for this layer call; logged the first time per layer."""
        layer = call.layer
        partners = self._tied.get(id(layer), [])
        capable = isinstance(backprops, Tensor) and has_ghost_rules(layer) and tie_allows_ghost(layer, partners)
        if call.flat is not None and get_clipped_sum(layer) is None:
            capable = False  # the reweighted re-run (ghost_vjp) needs the batch dimension
        if not capable or self.strategy == INSTANTIATE:
            choice = INSTANTIATE
        elif self.strategy == GHOST or partners:  # tied: both sides ghost, for the cross term
            choice = GHOST
        else:
            cost = get_ghost_cost(layer)
            choice = GHOST if cost is None or cost(layer, activations, backprops) else INSTANTIATE
        if call.name not in self._strategies:
            logger.debug("ghost clipping: layer '%s' (%s) -> %s", call.name, type(layer).__name__, choice)
        self._strategies[call.name] = choice
        return choice

    def _instantiate_uses(self, call: LayerCall, entry: _GhostEntry) -> None:
        """Instantiate the stored use of a ghost entry (its layer is now instantiated).

        Only a layer without a use merger gets here, so the entry holds one use: the one recorded
        by ``entry.call``, whose own inputs a ``torch.func`` fallback must re-run (not ``call``'s).
        """
        ((activations, backprops),) = entry.uses
        self._add_grads(call.rows_id, self._instantiate(entry.call, activations, backprops))
        self._instantiated_uses.add((call.rows_id, id(call.layer)))
        self._strategies[call.name] = INSTANTIATE

    def _add_grads(self, block: int, grads: dict[nn.Parameter, Tensor]) -> None:
        """Sum per-sample gradients per (block, parameter): uses and tied layers add up."""
        store = self._instantiated.setdefault(block, {})
        for p, g in grads.items():
            store[p] = g if p not in store else store[p] + g  # out of place: g may alias

    def _merged_use(self, entry: _GhostEntry) -> Use:
        """The entry's uses folded into one ``(activations, backprops)`` (kept for reuse)."""
        if entry.released:
            raise ConfigError(
                f"GhostClippingModule: the stored inputs and output gradients of layer "
                f"'{entry.name}' were freed by weighted_sum() as soon as the layer's clipped sum was "
                f"formed. Call squared_norms() before weighted_sum(), weighted_sum() once per "
                f"backward, then clear_per_sample() before the next forward."
            )
        if len(entry.uses) > 1:
            entry.uses[:] = [get_use_merger(entry.layer)(entry.layer, entry.uses)]
        return entry.uses[0]

    def _settle(self) -> None:
        """Re-decide layers used several times in a block, now that all their positions are known.

        A recurrent cell is called once per time step (T = 1 each: ghost looks cheap), but its
        merged uses span the whole sequence; if instantiating is cheaper for the merged shapes,
        its per-sample gradients are formed from the merged uses by its grad sampler. Then a
        ghost layer whose tied partner was instantiated in the same block is instantiated too.
        """
        if self.strategy == "auto":
            for key, entry in list(self._ghost.items()):
                uses = len(entry.uses)
                cost = get_ghost_cost(entry.layer)
                sampler = get_instantiator(entry.layer) or get_grad_sampler(entry.layer)
                if uses < 2 or cost is None or sampler is None:
                    continue
                activations, backprops = self._merged_use(entry)
                if not cost(entry.layer, activations, backprops):
                    self._instantiate_entry(key, entry, f"{uses} uses merged")
        untied = True
        while untied:  # until no block splits a tied parameter between the two paths
            untied = False
            for (block, layer_id), entry in list(self._ghost.items()):
                if any((block, id(p)) in self._instantiated_uses for p in self._tied.get(layer_id, [])):
                    self._instantiate_entry((block, layer_id), entry, "tied partner instantiated")
                    untied = True

    def _instantiate_entry(self, key: tuple[int, int], entry: _GhostEntry, reason: str) -> None:
        """Move a ghost entry to the instantiated store: per-sample gradients of its merged uses
        (its instantiator or grad sampler), or of its one recorded call (the fallback)."""
        del self._ghost[key]
        self._instantiated_uses.add(key)
        activations, backprops = self._merged_use(entry)
        sampler = get_instantiator(entry.layer) or get_grad_sampler(entry.layer)
        if sampler is not None:
            grads = _trainable_only(entry.layer, sampler(entry.layer, activations, backprops))
        else:
            grads = self._instantiate(entry.call, activations, backprops)
        self._add_grads(key[0], grads)
        if self._strategies.get(entry.name) != INSTANTIATE:
            logger.debug("ghost clipping: layer '%s' (%s) -> instantiate", entry.name, reason)
        self._strategies[entry.name] = INSTANTIATE

    def _entry_norms(self, entry: _GhostEntry) -> dict[nn.Parameter, Tensor]:
        """``{param: Tensor[B_block]}`` squared norms of one ghost entry (cached)."""
        if entry.norms is None:
            activations, backprops = self._merged_use(entry)
            entry.norms = get_norm_sampler(entry.layer)(entry.layer, activations, backprops)
        return entry.norms

    def _block_norms(self) -> Iterator[tuple[int, dict[nn.Parameter, Tensor]]]:
        """``(block, {param: Tensor[B_block]})`` from every ghost entry (and the cross terms of
        tied ghost layers) and instantiated block."""
        for (block, layer_id), entry in self._ghost.items():
            yield block, self._entry_norms(entry)
            for partner in self._tied.get(layer_id, []):
                other = self._ghost.get((block, id(partner)))
                if other is not None and id(partner) > layer_id:  # each tied pair once
                    yield block, self._cross_norms(entry, other)
        for block, grads in self._instantiated.items():
            yield block, {p: sq_norms(g) for p, g in grads.items()}

    def _cross_norms(self, first: _GhostEntry, second: _GhostEntry) -> dict[nn.Parameter, Tensor]:
        """``{shared param: 2 <grad_i(first), grad_i(second)>}`` ``[B_block]``: the cross term of
        the squared norm of a parameter two ghost layers share."""
        cross = get_cross_term(first.layer, second.layer)
        products = cross(self._merged_use(first), self._merged_use(second))
        return {p: 2 * value for p, value in products.items()}

    def _on_backward_end(self) -> None:
        """Nothing to write: ghost mode never sets ``p.grad_sample``."""

    def _sync_with_params(self) -> None:
        """Nothing to sync: the store is cleared only by :meth:`clear_per_sample`."""

    # ------------------------------------------------------------------ blocks of examples
    def _block_scale(self, block: int) -> int:
        """Factor between the captured backprops and each sample's own loss gradient (B or 1)."""
        return self._block_sizes[block] if self.mean_loss else 1

    def _block_offsets(self) -> dict[int, tuple[int, int]]:
        """``{block: (first row, rows)}`` of each block in the concatenated batch."""
        offsets, start = {}, 0
        for block, rows in self._block_sizes.items():
            offsets[block] = (start, rows)
            start += rows
        return offsets

    # ------------------------------------------------------------------ clipping interface
    def layer_strategies(self) -> dict[str, str]:
        """``{layer path: "ghost" | "instantiate"}`` as chosen for the captured blocks."""
        self._settle()
        return dict(self._strategies)

    def per_sample_batch_size(self) -> int:
        """Number of samples captured since the last clear (over all blocks; 0 if none)."""
        return sum(self._block_sizes.values())

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        """``{p: Tensor[B]}`` per-sample squared gradient norms for every trainable ``p``.

        Computed in float32 for 16-bit parameters; zero rows for blocks where ``p`` got nothing.
        """
        self._settle()
        self._report_strategies()
        batch, offsets = self.per_sample_batch_size(), self._block_offsets()
        params = [p for _, p in self.trainable_parameters()]
        parts: dict[tuple[int, int], list[Tensor]] = {}  # (block, id(p)) -> its terms
        for block, block_norms in self._block_norms():
            for p, value in block_norms.items():
                parts.setdefault((block, id(p)), []).append(value)
        norms = {}
        for p in params:
            dtype, terms = norm_dtype(p), [(block, parts.get((block, id(p)))) for block in offsets]
            if len(terms) == 1 and terms[0][1] is not None:  # one block: no zero rows to fill
                norms[p] = self._scaled_norm(terms[0][1], terms[0][0], dtype)
                continue
            norms[p] = torch.zeros(batch, dtype=dtype, device=p.device)
            for block, values in terms:
                if values is not None:
                    start, rows = offsets[block]
                    norms[p][start : start + rows] = self._scaled_norm(values, block, dtype)
        return norms

    def _report_strategies(self) -> None:
        """One log line summing up the layers' choices, when they first appear or change (each
        layer's own line is at DEBUG level: a transformer has dozens)."""
        if self._strategies == self._reported:
            return
        self._reported = dict(self._strategies)
        counts = {choice: sum(1 for c in self._reported.values() if c == choice)
                  for choice in (GHOST, INSTANTIATE)}
        logger.info("ghost clipping: %d layers by their ghost norms, %d with per-sample gradients "
                    "(the DEBUG log level names each layer's choice)", counts[GHOST], counts[INSTANTIATE])

    def _scaled_norm(self, values: list[Tensor], block: int, dtype: torch.dtype) -> Tensor:
        """One block's squared norms of a parameter from its terms, times the mean loss's ``B^2``."""
        scale = self._block_scale(block) ** 2
        if len(values) == 1:
            return values[0].to(dtype) * scale
        return summed_upper_bound(values, scale, dtype)  # tied layers: the terms may cancel

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """``{p: sum_b weights[p][b] * grad_b(p)}`` (shape ``p.shape``, in :func:`norm_dtype` of ``p``:
        float32 for 16-bit parameters, whose clipped sums are formed in float32).

        Ghost layers: one weighted matmul / kernel call per parameter from the stored A and G,
        which are freed as soon as the layer's sum is formed (so the peak memory holds the stored
        A and G or the sums, not both in full): call it once per backward, after
        :meth:`squared_norms`; instantiated layers: one weighted sum of their per-sample gradients.
        A sample with a zero weight is left out: its rows of A and G (or of its per-sample
        gradients) are zeroed before they meet the weights, so that even NaN values never reach
        the sums (:func:`~dptrain.grad_sample.ghost_math.dropped_samples`).
        """
        _check_weight_shapes(weights, self.per_sample_batch_size())
        self._settle()
        sums: dict[nn.Parameter, Tensor] = {}
        for _, block_sums in self._block_sums(weights, dropped_samples(weights)):
            for p, value in block_sums.items():
                sums[p] = value if p not in sums else sums[p] + value
        return {p: sums[p] if p in sums else torch.zeros_like(p, dtype=norm_dtype(p)) for p in weights}

    def _block_sums(self, weights: dict[nn.Parameter, Tensor],
                    dropped: Optional[Tensor]) -> Iterator[tuple[int, dict[nn.Parameter, Tensor]]]:
        """``(block, {param: weighted sum})`` from every ghost entry and instantiated block,
        leaving out the ``dropped`` samples (``Tensor[B]`` bool over all blocks, or None)."""
        offsets = self._block_offsets()

        def dropped_in(block: int) -> Optional[Tensor]:
            start, count = offsets[block]
            return None if dropped is None else dropped[start : start + count]

        scaled: dict[tuple[int, int], Tensor] = {}  # flat clipping passes one tensor for all params

        def rows(block: int, w: Tensor) -> Tensor:
            key = (block, id(w))
            if key not in scaled:
                start, count = offsets[block]
                scaled[key] = w[start : start + count] * self._block_scale(block)
            return scaled[key]

        for (block, _), entry in self._ghost.items():
            own = {p: rows(block, weights[p]) for p in entry.layer.parameters(recurse=False) if p in weights}
            if own:
                yield block, self._entry_sums(entry, own, dropped_in(block))
            entry.release()
        for block, grads in self._instantiated.items():
            yield block, {p: weighted_sample_sum(g, rows(block, weights[p]), dropped_in(block))
                          for p, g in grads.items() if p in weights}

    def _entry_sums(self, entry: _GhostEntry, weights: dict[nn.Parameter, Tensor],
                    dropped: Optional[Tensor]) -> dict[nn.Parameter, Tensor]:
        """``{param: sum_i w_i grad_i}`` of one ghost entry: its layer's clipped-sum rule, else
        one reweighted backward of the layer re-run on its recorded inputs (one use only).

        The ``dropped`` samples' rows (``Tensor[B_block]`` bool, or None) are zeroed in A and G,
        and in the re-run's inputs: ``0 * NaN`` is NaN, so a zero weight alone would not keep a
        non-finite sample out of the sum.
        """
        rule = get_clipped_sum(entry.layer)
        if rule is not None:
            activations, backprops = without_rows(self._merged_use(entry), dropped)
            return rule(entry.layer, activations, backprops, weights)
        ((_, backprops),) = entry.uses  # no use merger: one use per block (else instantiated)
        call = entry.call
        args, kwargs = without_rows((call.args, call.kwargs), dropped, self._batch_dim)
        self._capture_paused = True  # the re-run must not be recorded as a new call
        try:
            return vjp_clipped_sums(
                call.layer, args, kwargs, call.out_leaves[0], without_rows(backprops, dropped), weights,
                self._batch_dim,
            )
        finally:
            self._capture_paused = False

    def clear_per_sample(self) -> None:
        """Free everything captured (stored A, G, per-sample gradients, norms).

        Ghost mode never sets ``p.grad_sample`` (the base class's per-parameter reset is skipped:
        a walk over every parameter, twice per step)."""
        self._grad_samples.reset()
        self._ghost.clear()
        self._instantiated.clear()
        self._instantiated_uses.clear()
        self._block_sizes.clear()
        self._grad_before.clear()

    def check_complete(self) -> None:
        """Raise UnsupportedModuleError if a trainable param got a gradient ghost clipping missed.

        Hooked layers never give their parameters a ``.grad`` (it is skipped during their
        forward), so a ``.grad`` that changed since the parameter's first captured forward, or any
        ``.grad`` on a parameter nothing captured, comes from a use outside its module.
        """
        missing = [
            name
            for name, p in self.trainable_parameters()
            if p.grad is not None and self._grad_before.get(id(p), None) != _grad_state(p)
        ]
        if missing:
            self._refuse_eval_mode(missing)
            raise UnsupportedModuleError(
                f"Parameters {missing} received a gradient that ghost clipping did not capture: a "
                f"parameter was used outside the forward of the module that owns it (call that "
                f"module instead, or move the parameter into its own module), its module ran in "
                f"eval mode or under torch.no_grad(), or the model was called after remove_hooks()."
            )


def _grad_state(param: nn.Parameter) -> Optional[tuple[int, int]]:
    """Identity and version of ``param.grad`` (None when it has none): detects any new gradient."""
    return None if param.grad is None else (id(param.grad), param.grad._version)


def _trainable_only(layer: nn.Module, grads: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
    """``grads`` restricted to the layer's own trainable parameters."""
    trainable = {id(p) for p in _trainable_direct(layer)}
    return {p: g for p, g in grads.items() if id(p) in trainable}


def _check_weight_shapes(weights: dict[nn.Parameter, Tensor], batch: int) -> None:
    """Raise ConfigError unless every weight vector has one entry per captured sample."""
    for p, w in weights.items():
        if w.shape != (batch,):
            raise ConfigError(
                f"weighted_sum(weights): the weights of a parameter of shape {tuple(p.shape)} have "
                f"shape {tuple(w.shape)}; expected ({batch},), one weight per captured sample."
            )


def tied_layers(model: nn.Module) -> dict[int, list[nn.Module]]:
    """``{id(layer): other layers owning one of its parameters}`` for layers with tied weights."""
    owners: dict[int, list[nn.Module]] = {}
    for layer in model.modules():
        for p in layer.parameters(recurse=False):
            owners.setdefault(id(p), []).append(layer)
    partners: dict[int, list[nn.Module]] = {}
    for layers in owners.values():
        for layer in layers:
            for other in layers:
                known = partners.setdefault(id(layer), [])
                if other is not layer and all(other is not k for k in known):
                    known.append(other)
    return {k: v for k, v in partners.items() if v}


def has_ghost_rules(layer: nn.Module) -> bool:
    """Whether ghost mode can keep ``layer``'s A and G instead of its per-sample gradients: a norm
    sampler, and a clipped-sum rule unless the layer's uses cannot be merged (then the clipped sum
    may come from one reweighted backward of its single use)."""
    return get_norm_sampler(layer) is not None and (
        get_clipped_sum(layer) is not None or get_use_merger(layer) is None
    )


def tie_allows_ghost(layer: nn.Module, partners: list[nn.Module]) -> bool:
    """Whether a layer tied to ``partners`` may take the ghost path: each partner has ghost rules
    and a cross-term rule with it (else the norm of the shared parameter would miss cross terms)."""
    return all(has_ghost_rules(p) and get_cross_term(layer, p) is not None for p in partners)
