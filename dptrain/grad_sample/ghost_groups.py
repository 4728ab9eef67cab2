"""Ghost norms of GROUPS of rows (the examples of one user): the norm of a sum of per-row gradients.

A group's gradient is the sum of its rows' gradients. For a layer whose per-row gradient is a sum
over positions (a Linear: ``sum_t g_t a_t^T``; an Embedding: ``sum_t onehot(x_t) g_t^T``), the
group's gradient is the same sum over all positions of all its rows: the gradient of ONE row
whose positions are its rows' positions, one after the other. The layer's row grouper (or its use
merger, which folds uses the same way; :func:`~dptrain.grad_sample.ghost_registry.get_row_grouper`)
forms that row: use j holds the j-th row of every group (a group with fewer rows repeats its first
row there with a zero output gradient, which adds nothing), and the folded use has one row per
group. The layer's norm sampler then gives each group's squared norm exactly (as an upper bound,
as every ghost norm), pairs of positions across the group's rows included; the cross term of a
tied embedding and LM head likewise. Layers without a row grouper are instantiated (their
per-row gradients summed per group), once per layer, with a warning.

The clipped sum needs nothing new: ``sum_groups w_g sum_{rows of g} grad_row`` is the ghost
module's ``weighted_sum`` with each row weighted by its group's ``w_g``.

All rows of a group must come from one block of the ghost module (one forward pass, or the
passes of one backward): rows of different blocks have no stored cross terms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dptrain.errors import UnsupportedModuleError
from dptrain.grad_sample.ghost import GhostClippingModule, _GhostEntry, _trainable_only
from dptrain.grad_sample.ghost_math import norm_dtype, promoted, sq_norms, summed_upper_bound
from dptrain.grad_sample.ghost_registry import Use, get_cross_term, get_instantiator, get_row_grouper
from dptrain.grad_sample.registry import get_grad_sampler, get_norm_sampler

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # layer types already reported as instantiated for groups


def group_layout(groups: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """``(rows [K, G], present [K, G])``: row ``rows[j, g]`` is group g's j-th row (its first row
    where ``present[j, g]`` is False: g has fewer than j + 1 rows). ``groups`` is ``[B]`` int64 in
    ``[0, G)``; K is the largest group's row count."""
    counts = torch.bincount(groups, minlength=num_groups)
    order = torch.argsort(groups, stable=True)
    starts = counts.cumsum(0) - counts
    j = torch.arange(int(counts.max()), device=groups.device).unsqueeze(1)
    present = j < counts.unsqueeze(0)
    return order[torch.where(present, starts.unsqueeze(0) + j, starts.unsqueeze(0))], present


def _rows_of(value: object, rows: Tensor, batch: int) -> object:
    """``value[rows]`` for a tensor with the batch at dim 0, any other input as it is."""
    return value[rows] if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch else value


def grouped_use(layer: nn.Module, use: Use, layout: tuple[Tensor, Tensor]) -> Use:
    """The use with one row per group (see the module docstring), backprops in norm dtype."""
    activations, backprops = use
    rows, present = layout
    batch = backprops.shape[0]
    backprops = promoted(backprops)  # a 16-bit G is folded (zeros, copies) in float32
    uses = []
    for j in range(rows.shape[0]):
        keep = present[j].to(backprops.dtype).view(-1, *([1] * (backprops.dim() - 1)))
        uses.append(([_rows_of(a, rows[j], batch) for a in activations], backprops[rows[j]] * keep))
    return get_row_grouper(layer)(layer, uses) if len(uses) > 1 else uses[0]


def _instantiate_ungroupable(ghost: GhostClippingModule) -> None:
    """Instantiate every ghost entry whose layer has no row grouper (said once per layer type)."""
    for key, entry in list(ghost._ghost.items()):
        if get_row_grouper(entry.layer) is None:
            kind = type(entry.layer).__name__
            if kind not in _WARNED:
                _WARNED.add(kind)
                logger.warning(
                    "user-level ghost clipping: %s layers (first: '%s') have no rule folding a user's "
                    "examples into one (dptrain.grad_sample.ghost_registry.register_row_grouper); "
                    "their per-example gradients are instantiated (hooks) and summed per user.",
                    kind, entry.name)
            ghost._instantiate_entry(key, entry, "no row grouper (user level)")
    ghost._settle()  # a tied partner of an instantiated layer follows it


def _single_block(ghost: GhostClippingModule) -> int:
    """The one block of the chunk; UnsupportedModuleError when there are several."""
    blocks = list(ghost._block_sizes)
    if len(blocks) != 1:
        raise UnsupportedModuleError(
            f"user-level ghost clipping got {len(blocks)} blocks of examples in one chunk (forward "
            f"passes reached by separate backwards): the examples of a user must be in one "
            f"forward and backward pass per chunk. Run one forward and one backward per chunk "
            f"(dptrain.BatchMemoryManager), or use grad_sample_mode='hooks'.")
    return blocks[0]


class GroupedGhost:
    """A ghost module's captured chunk seen as G groups of rows.

    Args:
        ghost: the module, after the chunk's backward (before ``weighted_sum``).
        groups: ``[B]`` int64, the group of each row, in ``[0, num_groups)``.
    """

    def __init__(self, ghost: GhostClippingModule, groups: Tensor, num_groups: int) -> None:
        self.ghost = ghost
        self.block = _single_block(ghost)
        ghost._settle()
        _instantiate_ungroupable(ghost)
        self.groups = groups
        self.num_groups = num_groups
        self.layout = group_layout(groups, num_groups)
        self.scale = ghost._block_scale(self.block)  # captured G -> each row's own loss gradient
        self._uses: dict[int, Use] = {}

    def _use(self, entry: _GhostEntry) -> Use:
        """The entry's grouped use: kept only for a tied layer (its cross term needs it again), so
        that the peak memory holds one layer's grouped copy beside the stored A and G."""
        key = id(entry)
        if key in self._uses:
            return self._uses[key]
        use = grouped_use(entry.layer, self.ghost._merged_use(entry), self.layout)
        if self.ghost._tied.get(id(entry.layer)):
            self._uses[key] = use
        return use

    def release(self) -> None:
        """Drop the grouped uses kept for tied layers."""
        self._uses.clear()

    def _instantiated_sums(self) -> dict[nn.Parameter, Tensor]:
        """``{p: [G, *p.shape]}`` group sums of the instantiated layers' captured per-row gradients."""
        grads = self.ghost._instantiated.get(self.block, {})
        index = self.groups
        return {p: torch.zeros((self.num_groups, *g.shape[1:]), dtype=norm_dtype(g), device=g.device)
                .index_add_(0, index.to(g.device), g.to(norm_dtype(g))) for p, g in grads.items()}

    def squared_norms(self, factors: Tensor) -> dict[nn.Parameter, Tensor]:
        """``{p: [G]}`` upper bounds of ``||factors_g * sum_{rows of g} grad_row(p)||^2`` for every
        trainable p (``factors`` ``[G]`` float64: 1 / the user's count for a mean; grad_row the
        row's own gradient), in ``norm_dtype(p)``; zero for a parameter nothing captured."""
        terms: dict[nn.Parameter, list[Tensor]] = {}
        ghost = self.ghost
        for (block, layer_id), entry in ghost._ghost.items():
            for p, value in get_norm_sampler(entry.layer)(entry.layer, *self._use(entry)).items():
                terms.setdefault(p, []).append(value)
            for partner in ghost._tied.get(layer_id, []):
                other = ghost._ghost.get((block, id(partner)))
                if other is not None and id(partner) > layer_id:
                    cross = get_cross_term(entry.layer, other.layer)(self._use(entry), self._use(other))
                    for p, value in cross.items():
                        terms.setdefault(p, []).append(2 * value)
        for p, sums in self._instantiated_sums().items():
            terms.setdefault(p, []).append(sq_norms(sums))
        squared = (factors.double() * self.scale) ** 2
        norms = {}
        for _, p in ghost.trainable_parameters():
            if p in terms:
                norms[p] = summed_upper_bound(terms[p], squared, norm_dtype(p))  # type: ignore[arg-type]
            else:
                norms[p] = torch.zeros(self.num_groups, dtype=norm_dtype(p), device=p.device)
        return norms

    def group_gradients(self, selected: Sequence[int]) -> dict[nn.Parameter, Tensor]:
        """``{p: [S, *p.shape]}`` the summed own gradients of the ``selected`` groups' rows (dense:
        for a group cut between two chunks), in ``norm_dtype(p)``."""
        index = torch.tensor(list(selected), dtype=torch.long, device=self.groups.device)
        out: dict[nn.Parameter, Tensor] = {}
        for entry in self.ghost._ghost.values():
            activations, backprops = self._use(entry)
            rows = [_rows_of(a, index, self.num_groups) for a in activations]
            sampler = get_instantiator(entry.layer) or get_grad_sampler(entry.layer)
            if sampler is None:
                raise UnsupportedModuleError(
                    f"user-level ghost clipping: a user's examples are split between two chunks "
                    f"and layer '{entry.name}' ({type(entry.layer).__name__}) has a norm sampler but "
                    f"no grad sampler to carry their partial gradient; register one "
                    f"(dptrain.register_grad_sampler), or use grad_sample_mode='hooks' "
                    f"(privacy.grad_sample_mode=hooks).")
            grads = _trainable_only(entry.layer, sampler(entry.layer, rows, backprops[index]))
            for p, g in grads.items():
                g = g.to(norm_dtype(p)) * self.scale
                out[p] = g if p not in out else out[p] + g
        for p, sums in self._instantiated_sums().items():
            g = sums[index.to(sums.device)] * self.scale
            out[p] = g if p not in out else out[p] + g
        return out
