"""User-level DP-SGD: clip each sampled user's mean gradient, not each example's.

With `privacy_unit="user"` (the plan's `UserUnit`, dptrain.privacy.unit.user, which builds the
loader and this clipper) a batch holds the (capped) examples of Poisson-sampled users, user by
user (`dptrain.data.user_sampling`), and the loader records each row's user position. Per chunk
of per-sample gradients g_b (b over the chunk's rows, user position u(b)):

    mean_u = (1 / n_u) sum_{b: u(b) = u} g_b        (n_u: the user's rows in the batch)
    clipped sum = sum_u min(1, C / ||mean_u||) mean_u

so one user moves the noise-free sum by at most C whatever its number of examples, and the noise
N(0, (sigma C)^2) and the accountant (q = batch_size / N_users, N = N_users) are those of
example-level DP-SGD with users in place of examples. A user with one example is clipped exactly
as example-level DP-SGD clips that example.

`UserLevelClipper` wraps any example-level clipper (flat, per-layer, adaptive: adaptive's
"samples" are then users) and presents the users of a chunk to it as samples
(`UserMeanSource`). A logical batch split into physical chunks (BatchMemoryManager) may cut a
user in two: its partial gradient sum is carried to the next chunks and the user is clipped once
its last row is in. Its rows are contiguous unless the collate function reordered them
(`dptrain.data.row_order`: the loader then records each row's user in the collated order), in
which case several users' partial sums may be carried at once.

Ghost clipping (`grad_sample_mode="ghost"`) never forms per-example gradients; the norm of a
user's mean is not a function of its examples' norms, but the ghost Gram trick gives it from the
positions of all the user's examples: `dptrain.privacy.user_level_ghost`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.ghost_math import dropped_samples, norm_dtype, sq_norms, weighted_sample_sum
from dptrain.grad_sample.module import GradSampleModule
from dptrain.privacy.clipping import Clipper, PerSampleSource, ScalarNoise

#: The ledger's mechanism.privacy_unit for a user-level run.
USER_PRIVACY_UNIT = ("one user: all their training examples, whatever their number (add/remove: "
                     "datasets differing by one user's examples)")


def check_user_level_source(source: Any) -> None:
    """ConfigError unless `source` is a GradSampleModule (hooks) or a GhostClippingModule (ghost):
    the user-level clippers need one of them to group a user's examples."""
    if not isinstance(source, GradSampleModule):
        raise ConfigError(
            f"privacy_unit='user' needs the model wrapped by dptrain (grad_sample_mode='hooks' or "
            f"'ghost', privacy.grad_sample_mode), not a {type(source).__name__} passed as module: "
            f"pass the plain model.")


def _per_sample_grads(source: PerSampleSource, params: Sequence[nn.Parameter],
                      rows: int) -> dict[nn.Parameter, Tensor]:
    """{p: Tensor[rows, *p.shape]} per-example gradients of the hooks source (zeros for a
    parameter that got none), in `norm_dtype(p)`."""
    grads = {}
    for p in params:
        gs = getattr(p, "grad_sample", None)
        grads[p] = (torch.zeros((rows, *p.shape), dtype=norm_dtype(p), device=p.device)
                    if gs is None else gs.to(norm_dtype(p)))
    return grads


class UserMeanSource:
    """The users of one chunk as the samples of a per-sample source: `squared_norms` and
    `weighted_sum` of each complete user's mean gradient (Tensor[U] and Tensor[*p.shape])."""

    def __init__(self, means: dict[nn.Parameter, Tensor]) -> None:
        self.means = means  # {p: Tensor[U, *p.shape]}

    def per_sample_batch_size(self) -> int:
        return next(iter(self.means.values())).shape[0] if self.means else 0

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        users = self.per_sample_batch_size()
        return {p: sq_norms(m.reshape(users, -1)) for p, m in self.means.items()}

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        """A user with a zero weight (a non-finite mean: one of its examples' gradients is not
        finite) is left out: its mean never reaches the sum (`ghost_math.dropped_samples`)."""
        dropped = dropped_samples(weights)
        return {p: weighted_sample_sum(m, weights[p], dropped) for p, m in self.means.items()}

    def clear_per_sample(self) -> None:
        self.means = {}

    def check_complete(self) -> None:
        """Nothing to check: the wrapped source was checked by the optimizer."""


class UserLevelClipper(Clipper):
    """An example-level clipper applied to users' mean gradients (see the module docstring).

    Args:
        inner: the clipper of the users' means (its `max_grad_norm` is the user's sensitivity).
        params: the trainable parameters, in model order.
        user_groups: fn() -> Tensor[B] int64, the user position of each row of the logical batch
            handed out last (`UserDPDataLoader.batch_user_groups`).
    """

    def __init__(self, inner: Clipper, params: Sequence[nn.Parameter],
                 user_groups: Callable[[], Tensor | None]) -> None:
        self.inner = inner
        self.name = inner.name
        self.params = list(params)
        self.user_groups = user_groups
        self._batch: Tensor | None = None   # the user positions of the batch being clipped
        self._offset = 0                    # its rows clipped (or carried) so far
        self._totals: Tensor | None = None  # Tensor[U_batch]: each user's rows in the batch
        # the users whose rows are not all clipped yet: {user: (rows seen, {p: their sum})}
        self._carry: dict[int, tuple[int, dict[nn.Parameter, Tensor]]] = {}

    @property
    def max_grad_norm(self) -> float:
        return self.inner.max_grad_norm

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return self.inner.factors(squared)

    def _chunk_groups(self, rows: int) -> Tensor:
        """The user positions of the current chunk's `rows` rows (the next rows of the batch)."""
        batch = self.user_groups()
        if batch is not self._batch:  # a new batch was handed out: start at its first row
            self._batch, self._offset, self._carry = batch, 0, {}
            self._totals = None if batch is None else torch.bincount(batch)
        if batch is None or self._offset + rows > len(batch):
            raise PrivacyError(
                f"user-level clipping got {rows} per-example gradients but the batch the private "
                f"loader handed out last has {0 if batch is None else len(batch) - self._offset} "
                "rows left: the model must be run on the rows of the loader's batches, in order "
                "(use dptrain.BatchMemoryManager to split them), so that each row's user is known.")
        groups = batch[self._offset: self._offset + rows]
        self._offset += rows
        return groups

    def user_means(self, source: PerSampleSource) -> dict[nn.Parameter, Tensor]:
        """{p: Tensor[U, *p.shape]}: the mean gradient of each user whose last row is in this
        chunk (its rows of earlier chunks included); the partial sums of users with rows still to
        come are carried to the next chunks. A user's rows need not be contiguous: a collate
        function may have reordered them (`dptrain.data.row_order`), and each row's user is the
        one the loader recorded for it."""
        rows = source.per_sample_batch_size()
        groups = self._chunk_groups(rows)
        users, local = torch.unique(groups, return_inverse=True)  # Tensor[U], Tensor[rows]
        grads = _per_sample_grads(source, self.params, rows)
        continued = [(j, self._carry.pop(u)) for j, u in enumerate(users.tolist())
                     if u in self._carry]
        if len(users) == rows and not continued:  # one row per user: its gradient is its sum
            sums, users = grads, groups  # views of p.grad_sample, never written to; row order
            counts = torch.ones(rows, dtype=torch.float64)
        else:
            sums = {p: torch.zeros((len(users), *p.shape), dtype=g.dtype, device=g.device)
                    .index_add_(0, local.to(g.device), g) for p, g in grads.items()}
            counts = torch.bincount(local, minlength=len(users)).to(torch.float64)
            for j, (carried, partial) in continued:
                counts[j] += carried
                for p in sums:
                    sums[p][j] += partial[p]
        sums, counts = self._carry_incomplete(users, counts, sums)
        if bool((counts == 1).all()):
            return sums
        return {p: s.div_(counts.to(s.dtype).view(-1, *([1] * (s.dim() - 1))).to(s.device))
                for p, s in sums.items()}

    def _carry_incomplete(self, users: Tensor, counts: Tensor, sums: dict[nn.Parameter, Tensor]
                          ) -> tuple[dict[nn.Parameter, Tensor], Tensor]:
        """(sums, counts) of the complete users only: a user (`users[j]`, with `counts[j]` rows
        and gradient sum `sums[p][j]` so far) with rows of the batch still to come is carried to
        the next chunks instead."""
        complete = counts == self._totals[users].to(torch.float64)  # type: ignore[index]
        if bool(complete.all()):
            return sums, counts
        for j in (~complete).nonzero().flatten().tolist():
            partial = {p: s[j].clone() for p, s in sums.items()}
            self._carry[int(users[j])] = (int(counts[j]), partial)
        return {p: s[complete.to(s.device)] for p, s in sums.items()}, counts[complete]

    def clip(self, source: PerSampleSource) -> dict[nn.Parameter, Tensor]:
        """Clipped sum of the complete users' mean gradients: {p: Tensor[*p.shape]} in
        `norm_dtype(p)` (zeros when the chunk completes no user)."""
        means = self.user_means(source)
        if not means or next(iter(means.values())).shape[0] == 0:
            return {p: torch.zeros_like(p, dtype=norm_dtype(p)) for p in self.params}
        return self.inner.clip(UserMeanSource(means))  # type: ignore[arg-type]

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        return self.inner.gradient_noise_multiplier(noise_multiplier)

    def end_step(self, scalar_noise: ScalarNoise, expected_batch_size: float) -> None:
        self.inner.end_step(scalar_noise, expected_batch_size)

    def reset_accumulation(self) -> None:
        self.inner.reset_accumulation()
        self._carry = {}

    def pop_excluded(self) -> Tensor | int:
        """Users excluded for a non-finite mean (the inner clipper counts them)."""
        return self.inner.pop_excluded()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
