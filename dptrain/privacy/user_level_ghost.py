"""User-level DP-SGD with ghost clipping: each user's MEAN gradient clipped, never formed per example.

`dptrain.privacy.user_level` defines the user's gradient as the mean of its examples' gradients,
``mean_u = (1 / n_u) sum_{b: u(b) = u} g_b`` (n_u: the user's rows in the logical batch), and
clips ``mean_u`` to C. Its norm is not a function of the examples' norms, but for a layer whose
example gradient is a sum over positions (Linear: ``sum_t g_t a_t^T``; Embedding; the norms'
``sum_t g_t * h(x_t)``) the user's summed gradient is the same sum over ALL its examples'
positions: the ghost Gram trick gives its norm exactly, pairs of tokens across the user's examples
included (`dptrain.grad_sample.ghost_groups`); the ``1 / n_u`` of the mean scales it. Layers
without such a rule get their per-example gradients instantiated and summed per user (said once).

The clipped sum ``sum_u w_u mean_u`` is the ghost module's weighted sum with each row weighted by
``w_{u(b)} / n_u``: nothing per user is formed. A user cut between physical chunks (a chunk's
last user; with rows reordered by a collate function, possibly several) is the exception: its
rows' summed gradient is formed (one gradient-sized tensor per parameter, as the hooks path
carries) and carried to the chunk where the user ends, which clips it once as a whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.ghost_groups import GroupedGhost
from dptrain.grad_sample.ghost_math import norm_dtype, sq_norms
from dptrain.privacy.clipping import Clipper, PerSampleSource
from dptrain.privacy.user_level import UserLevelClipper


class _Users:
    """The complete users of one chunk as the samples of a per-sample source (for the inner
    clipper): their mean gradients' squared norms ``{p: [U]}`` and weighted sums."""

    def __init__(self, norms: dict[nn.Parameter, Tensor], weighted_sum: Any) -> None:
        self.norms, self._weighted_sum = norms, weighted_sum

    def per_sample_batch_size(self) -> int:
        return next(iter(self.norms.values())).shape[0] if self.norms else 0

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        return self.norms

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return self._weighted_sum(weights)

    def clear_per_sample(self) -> None:
        self.norms = {}

    def check_complete(self) -> None:
        """Nothing to check: the ghost module was checked by the optimizer."""


class GhostUserLevelClipper(UserLevelClipper):
    """:class:`~dptrain.privacy.user_level.UserLevelClipper` over a GhostClippingModule: the same
    users, means and carry across chunks (``_carry``: {user: (rows seen, {p: their summed
    gradient})}), from ghost norms (see the module docstring). A user's rows need not be
    contiguous: a collate function may have reordered them (`dptrain.data.row_order`)."""

    def clip(self, source: PerSampleSource) -> dict[nn.Parameter, Tensor]:
        """Clipped sum of the complete users' mean gradients: ``{p: Tensor[*p.shape]}`` in
        ``norm_dtype(p)`` (zeros when the chunk completes no user)."""
        ghost: GhostClippingModule = source  # type: ignore[assignment]
        groups = self._chunk_groups(ghost.per_sample_batch_size())
        users, local = torch.unique(groups, return_inverse=True)  # Tensor[U], Tensor[rows]
        count = len(users)
        factors = 1.0 / self._totals[users].double()  # type: ignore[index]  # the mean's 1 / n_u
        seen = torch.bincount(local, minlength=count).double()
        carried = {j: self._carry.pop(int(u)) for j, u in enumerate(users.tolist())
                   if int(u) in self._carry}
        for j, (rows_before, _) in carried.items():
            seen[j] += rows_before
        complete = seen == self._totals[users].double()  # type: ignore[index]
        grouped = GroupedGhost(ghost, local.to(torch.long), count)
        cut = sorted(set(carried) | set((~complete).nonzero().flatten().tolist()))
        dense = dict(zip(cut, _split(grouped.group_gradients(cut), len(cut)))) if cut else {}
        norms = grouped.squared_norms(factors)
        grouped.release()
        for j, (_, earlier) in carried.items():  # the user's rows of earlier chunks join these
            dense[j] = _added(earlier, dense[j])
        for j in (~complete).nonzero().flatten().tolist():  # rows still to come: carried on
            self._carry[int(users[j])] = (int(seen[j]), dense[j])
        done = complete.nonzero().flatten()
        if len(done) == 0:
            return {p: torch.zeros_like(p, dtype=norm_dtype(p)) for p in self.params}
        for j in (j for j in carried if bool(complete[j])):  # its whole sum's norm
            for p, norm in norms.items():
                whole = dense[j].get(p)
                if whole is not None:
                    norm[j] = sq_norms((whole * factors[j].to(whole.dtype)).unsqueeze(0))[0]
        head = {p: n[done.to(n.device)] for p, n in norms.items()}

        def weighted_sum(weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
            sums = ghost.weighted_sum(_row_weights(weights, factors, local, done, count))
            for k, j in enumerate(done.tolist()):
                for p, earlier in carried.get(j, (0, {}))[1].items():
                    scale = weights[p][k].double() * factors[j] if p in weights else 0.0
                    if float(scale) != 0.0:  # an excluded user's (maybe non-finite) sum never enters
                        sums[p] = sums[p] + earlier * scale.to(earlier.dtype)
            return sums

        return self.inner.clip(_Users(head, weighted_sum))  # type: ignore[arg-type]


def _added(earlier: dict[nn.Parameter, Tensor], now: dict[nn.Parameter, Tensor]
           ) -> dict[nn.Parameter, Tensor]:
    """``earlier + now`` per parameter (a parameter in one of them only: as it is)."""
    total = dict(earlier)
    for p, g in now.items():
        total[p] = total[p] + g if p in total else g
    return total


def _split(grads: dict[nn.Parameter, Tensor], count: int) -> list[dict[nn.Parameter, Tensor]]:
    """``{p: [S, *p.shape]}`` -> S dicts ``{p: [*p.shape]}``."""
    return [{p: g[i] for p, g in grads.items()} for i in range(count)]


def _row_weights(weights: dict[nn.Parameter, Tensor], factors: Tensor, local: Tensor, done: Tensor,
                 users: int) -> dict[nn.Parameter, Tensor]:
    """Each row's weight ``w_{u(b)} / n_u`` (``[B]`` per parameter; 0 for the rows of a user that
    ends in a later chunk); ``weights[p]`` ``[len(done)]``, one per complete user (``done``: their
    positions among the chunk's ``users``), one tensor per distinct weight tensor (flat clipping
    shares one)."""
    rows: dict[int, Tensor] = {}
    out = {}
    for p, w in weights.items():
        if id(w) not in rows:
            per_user = torch.zeros(users, dtype=torch.float64, device=w.device)
            at = done.to(w.device)
            per_user[at] = w.double() * factors.to(w.device)[at]
            rows[id(w)] = per_user[local.to(w.device)].to(w.dtype)
        out[p] = rows[id(w)]
    return out


def user_level_clipper(inner: Clipper, params: list[nn.Parameter], user_groups: Any,
                       source: Any) -> UserLevelClipper:
    """The user-level clipper of `source`: ghost norms for a GhostClippingModule, else the
    per-example gradients of a GradSampleModule."""
    cls = GhostUserLevelClipper if isinstance(source, GhostClippingModule) else UserLevelClipper
    return cls(inner, params, user_groups)
