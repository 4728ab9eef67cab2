"""User-level DP-SGD: clip each sampled user's mean gradient, not each example's.

With `privacy_unit="user"` a batch holds the (capped) examples of Poisson-sampled users, user by
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
user in two: its rows are contiguous, so only the chunk's last user can be unfinished; its partial
gradient sum is carried to the next chunk and the user is clipped once complete.

Ghost clipping (`grad_sample_mode="ghost"`) never forms per-example gradients; the norm of a
user's mean is not a function of its examples' norms, but the ghost Gram trick gives it from the
positions of all the user's examples: `dptrain.privacy.user_level_ghost`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError, PrivacyError
from dptrain.grad_sample.ghost_math import norm_dtype, sq_norms
from dptrain.grad_sample.module import GradSampleModule
from dptrain.privacy.clipping import Clipper, PerSampleSource, ScalarNoise

PRIVACY_UNITS = ("example", "user")
#: The ledger's mechanism.privacy_unit for a user-level run.
USER_PRIVACY_UNIT = ("one user: all their training examples, whatever their number (add/remove: "
                     "datasets differing by one user's examples)")


@dataclass(frozen=True)
class UserLevelRequest:
    """What make_private needs for user-level DP: one user id per training example and the cap."""

    user_ids: Any
    max_examples_per_user: int | None


def user_level_request(privacy_unit: str, user_ids: Any, max_examples_per_user: int | None,
                       grad_sample_mode: str, distributed: bool) -> UserLevelRequest | None:
    """The user-level request of make_private's arguments (None for example level), checked:
    ConfigError naming the argument for an unknown unit, missing ids or DDP (hooks and ghost
    mode both serve user level; `grad_sample_mode` is checked where the model is wrapped)."""
    if privacy_unit not in PRIVACY_UNITS:
        raise ConfigError(f"privacy_unit={privacy_unit!r} is unknown (privacy.unit): use "
                          f"'example' (the default) or 'user'.")
    if privacy_unit == "example":
        if user_ids is not None or max_examples_per_user is not None:
            raise ConfigError("user_ids / max_examples_per_user (dataset.user_column, "
                              "privacy.max_examples_per_user) are only used with "
                              "privacy_unit='user' (privacy.unit=user): set it, or drop them.")
        return None
    if user_ids is None:
        raise ConfigError("privacy_unit='user' needs user_ids, one user id per training example "
                          "(from the CLI: dataset.user_column=COLUMN of a text dataset).")
    if distributed:
        raise ConfigError("privacy_unit='user' is not supported with a DistributedDataParallel "
                          "or fully sharded (FSDP) model (hardware=ddp, hardware=fsdp): train "
                          "user-level runs on one process.")
    return UserLevelRequest(user_ids, max_examples_per_user)


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
        return {p: torch.tensordot(weights[p].to(m.dtype), m, dims=1)
                for p, m in self.means.items()}

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
        self._carry: tuple[int, int, dict[nn.Parameter, Tensor]] | None = None  # (user, rows, sums)

    @property
    def max_grad_norm(self) -> float:
        return self.inner.max_grad_norm

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return self.inner.factors(squared)

    def _chunk_groups(self, rows: int) -> Tensor:
        """The user positions of the current chunk's `rows` rows (the next rows of the batch)."""
        batch = self.user_groups()
        if batch is not self._batch:  # a new batch was handed out: start at its first row
            self._batch, self._offset, self._carry = batch, 0, None
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
        """{p: Tensor[U, *p.shape]}: the mean gradient of each user complete at the end of this
        chunk (its rows carried from the previous chunk included); an unfinished last user's sum
        is carried to the next chunk."""
        rows = source.per_sample_batch_size()
        groups = self._chunk_groups(rows)
        first, last = int(groups[0]), int(groups[-1])
        local = groups - first                                     # Tensor[rows] in [0, U)
        users = last - first + 1
        grads = _per_sample_grads(source, self.params, rows)
        continued = self._carry is not None and self._carry[0] == first
        if users == rows and not continued:  # one row per user: its gradient is its mean
            sums = grads  # views of p.grad_sample, never written to
        else:
            sums = {p: torch.zeros((users, *p.shape), dtype=g.dtype, device=g.device)
                    .index_add_(0, local.to(g.device), g) for p, g in grads.items()}
        counts = torch.bincount(local, minlength=users).to(torch.float64)
        if self._carry is not None:
            user, carried, partial = self._carry
            if user == first:
                counts[0] += carried
                for p in sums:
                    sums[p][0] += partial[p]
            self._carry = None
        total_rows = int((self._batch == last).sum())  # type: ignore[operator]
        if int(counts[-1]) < total_rows:  # the last user continues in the next chunk
            self._carry = (last, int(counts[-1]), {p: s[-1].clone() for p, s in sums.items()})
            sums, counts = {p: s[:-1] for p, s in sums.items()}, counts[:-1]
        if bool((counts == 1).all()):
            return sums
        return {p: s.div_(counts.to(s.dtype).view(-1, *([1] * (s.dim() - 1))).to(s.device))
                for p, s in sums.items()}

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
        self._carry = None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def privacy_unit_of(engine: Any) -> str:
    """"user" for an engine made private at user level, else "example"."""
    return getattr(engine, "privacy_unit", "example")


def user_level_mechanism(engine: Any) -> dict[str, Any]:
    """The ledger's mechanism entries of a user-level run: the unit epsilon protects, the number
    of users N (the accountant's; q = batch_size / N) and the cap on a sampled user's examples."""
    sampler = engine.data_loader.poisson_sampler
    return {"privacy_unit": USER_PRIVACY_UNIT, "num_users": int(sampler.num_samples),
            "max_examples_per_user": sampler.max_examples_per_user,
            "user_sampling": "poisson over users (ULS); a user's mean gradient is clipped"}
