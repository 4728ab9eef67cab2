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
``w_{u(b)} / n_u``: nothing per user is formed. A user cut between two physical chunks (its rows
are contiguous, so only a chunk's last user) is the exception: its rows' summed gradient is formed
(one gradient-sized tensor per parameter, as the hooks path carries) and carried to the chunk
where the user ends, which clips it once as a whole.
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
    users, means and carry across chunks, from ghost norms (see the module docstring)."""

    def clip(self, source: PerSampleSource) -> dict[nn.Parameter, Tensor]:
        """Clipped sum of the complete users' mean gradients: ``{p: Tensor[*p.shape]}`` in
        ``norm_dtype(p)`` (zeros when the chunk completes no user)."""
        ghost: GhostClippingModule = source  # type: ignore[assignment]
        groups = self._chunk_groups(ghost.per_sample_batch_size())
        first, last = int(groups[0]), int(groups[-1])
        local, users = groups - first, last - first + 1
        totals = torch.bincount(self._batch, minlength=last + 1)[first:last + 1].double()  # type: ignore[arg-type]
        factors = 1.0 / totals  # [users]: the mean's 1 / n_u
        carried = self._carry if self._carry is not None and self._carry[0] == first else None
        self._carry = None
        seen_last = int((local == users - 1).sum()) + (carried[1] if carried and users == 1 else 0)
        complete = users - 1 if seen_last < int(totals[-1]) else users  # users [0, complete) end here
        grouped = GroupedGhost(ghost, local.to(torch.long), users)
        cut = sorted(({0} if carried else set()) | ({users - 1} if complete < users else set()))
        dense = dict(zip(cut, _split(grouped.group_gradients(cut), len(cut)))) if cut else {}
        norms = grouped.squared_norms(factors)
        grouped.release()
        if carried:  # the first user's rows of earlier chunks join this chunk's
            dense[0] = {p: carried[2][p] + g for p, g in dense[0].items()}
            if complete:
                for p, norm in norms.items():
                    whole = dense[0].get(p)
                    if whole is not None:
                        norm[0] = sq_norms((whole * factors[0].to(whole.dtype)).unsqueeze(0))[0]
        if complete < users:  # the last user continues in the next chunk
            self._carry = (last, seen_last, dense[users - 1])
        if complete == 0:
            return {p: torch.zeros_like(p, dtype=norm_dtype(p)) for p in self.params}
        head = {p: n[:complete] for p, n in norms.items()}

        def weighted_sum(weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
            sums = ghost.weighted_sum(_row_weights(weights, factors, local, complete, users))
            if carried:
                for p, earlier in carried[2].items():
                    if p in weights:
                        sums[p] = sums[p] + earlier * (weights[p][0].double() * factors[0]).to(earlier.dtype)
            return sums

        return self.inner.clip(_Users(head, weighted_sum))  # type: ignore[arg-type]


def _split(grads: dict[nn.Parameter, Tensor], count: int) -> list[dict[nn.Parameter, Tensor]]:
    """``{p: [S, *p.shape]}`` -> S dicts ``{p: [*p.shape]}``."""
    return [{p: g[i] for p, g in grads.items()} for i in range(count)]


def _row_weights(weights: dict[nn.Parameter, Tensor], factors: Tensor, local: Tensor, complete: int,
                 users: int) -> dict[nn.Parameter, Tensor]:
    """Each row's weight ``w_{u(b)} / n_u`` (``[B]`` per parameter; 0 for the rows of a user that
    ends in a later chunk), one tensor per distinct weight tensor (flat clipping shares one)."""
    rows: dict[int, Tensor] = {}
    out = {}
    for p, w in weights.items():
        if id(w) not in rows:
            per_user = torch.zeros(users, dtype=torch.float64, device=w.device)
            per_user[:complete] = w.double() * factors[:complete].to(w.device)
            rows[id(w)] = per_user[local.to(w.device)].to(w.dtype)
        out[p] = rows[id(w)]
    return out


def user_level_clipper(inner: Clipper, params: list[nn.Parameter], user_groups: Any,
                       source: Any) -> UserLevelClipper:
    """The user-level clipper of `source`: ghost norms for a GhostClippingModule, else the
    per-example gradients of a GradSampleModule."""
    cls = GhostUserLevelClipper if isinstance(source, GhostClippingModule) else UserLevelClipper
    return cls(inner, params, user_groups)
