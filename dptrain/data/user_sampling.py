"""User-level Poisson sampling (ULS): users, not examples, join each batch with probability q.

Each batch draws one coin per user: user u joins with probability q = batch_size / N_users. A
sampled user then contributes its examples, at most `max_examples_per_user` of them (chosen
uniformly at random, from the same coin source, when it has more). The batch lists the examples
user by user (contiguous), and the sampler records, per batch, the user position of each example:
a `Tensor[B]` of int64 in `[0, U)` (U the batch's users, non-decreasing), handed to the DP
optimizer's user-level clipper (`dptrain.privacy.user_level`) in the batch's record, beside its q
(`BatchRecord.user_groups`). A collate function that reorders the examples reports how
(`dptrain.data.row_order`), and the record follows the rows; one that cannot say is refused.

This is user-level sampling as in Charles et al. 2024 and Chua et al. 2024 (ULS), as opposed to
example-level sampling with a per-user contribution bound (ELS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dptrain.checks import check_sample_rate
from dptrain.data.batch_record import BatchRecord
from dptrain.data.fingerprint import user_assignment_fingerprint
from dptrain.data.row_order import reorder, reports_row_order, row_order_collate
from dptrain.data.sampling import DPDataLoader, PoissonBatchSampler, _loader_kwargs, dataset_size
from dptrain.errors import ConfigError
from dptrain.randomness import uniform


def user_groups(user_ids: Tensor | Sequence[Any], num_examples: int,
                argument: str = "user_ids") -> list[Tensor]:
    """The example indices of each user, users in order of first appearance: a list of int64
    `Tensor[n_u]` (n_u >= 1) whose union is range(num_examples).

    `user_ids` holds one id per training example (any hashable values: ints, strings).
    Raises ConfigError naming `argument` when its length is not `num_examples`.
    """
    ids = user_ids.tolist() if isinstance(user_ids, Tensor) else list(user_ids)
    if len(ids) != num_examples:
        raise ConfigError(f"{argument} has {len(ids)} ids but the training data has {num_examples} "
                          f"examples: give exactly one user id per training example, in the "
                          f"dataset's order.")
    members: dict[Any, list[int]] = {}
    for index, uid in enumerate(ids):
        members.setdefault(uid, []).append(index)
    return [torch.tensor(rows, dtype=torch.int64) for rows in members.values()]


def check_max_examples_per_user(value: Any, key: str = "max_examples_per_user") -> int | None:
    """`value` as a positive int, or None (no cap); ConfigError naming `key` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be an integer >= 1 (the most examples one sampled "
                          f"user contributes to a batch) or null (all of its examples).")
    return value


class UserPoissonBatchSampler(PoissonBatchSampler):
    """Batches of the examples of a Poisson-sampled subset of users.

    Args:
        groups: the example indices of each user (`user_groups`); N_users = len(groups).
        sample_rate: q in (0, 1], each user's inclusion probability per batch.
        max_examples_per_user: k, the most examples a sampled user contributes (None: all).
        steps, generator, secure, sample_rate_schedule: as `PoissonBatchSampler` (over users).
    """

    #: a user's coin decides all of its examples: secure rank sharding, which draws per owned
    #: example, does not apply (dptrain.data.sharding)
    draws_per_example = False

    def __init__(self, groups: list[Tensor], sample_rate: float,
                 max_examples_per_user: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None) -> None:
        super().__init__(len(groups), sample_rate, steps=steps, generator=generator,
                         secure=secure, sample_rate_schedule=sample_rate_schedule)
        self.groups = groups
        self.max_examples_per_user = check_max_examples_per_user(max_examples_per_user)
        self._drawn_groups: Tensor | None = None  # user positions of the batch `draw` made last

    def assignment_fingerprint(self) -> str:
        """The SHA-256 of this sampler's users (`groups`, in order) and cap: what a resume
        compares, beside the records', to call a replay exact
        (`dptrain.data.fingerprint.user_assignment_fingerprint`)."""
        return user_assignment_fingerprint(self.groups, self.max_examples_per_user)

    def _examples_of(self, user: int) -> Tensor:
        """The examples user `user` contributes: all, or k of them drawn at random (sorted)."""
        rows = self.groups[user]
        cap = self.max_examples_per_user
        if cap is None or len(rows) <= cap:
            return rows
        keep = uniform(len(rows), self.generator, self.secure).argsort()[:cap]
        return rows[keep.sort().values]

    def draw_batch(self) -> list[int]:
        """One user-level Poisson batch: the (capped) examples of each user whose coin is < q,
        user by user; its user positions go to its record (`_record`)."""
        users = super().draw_batch()
        parts = [self._examples_of(u) for u in users]
        counts = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        self._drawn_groups = torch.repeat_interleave(torch.arange(len(parts)), counts)
        return torch.cat(parts).tolist() if parts else []

    def _record(self, index: int, rate: float, batch: list[int]) -> BatchRecord:
        """The batch's record, with the user position of each of its examples."""
        return BatchRecord(index=index, sample_rate=rate, indices=tuple(batch),
                           user_groups=self._drawn_groups)

    @property
    def handed_out_groups(self) -> Tensor | None:
        """User positions (Tensor[B]) of the rows of the batch most recently handed out."""
        record = self.handed_out_record
        return None if record is None else record.user_groups

    def reorder_handed_out(self, order: Tensor) -> None:
        """The batch handed out last reached the loop with its rows reordered by the collate
        function (row r holds its example order[r]): its record's user positions and rows follow
        the rows."""
        record = self.handed_out_record
        if record is not None and record.user_groups is not None:
            groups = reorder(record.user_groups, order)   # checks `order` is a permutation
            indices = None if record.indices is None else tuple(
                record.indices[int(i)] for i in order.tolist())
            self.handed_out_record = replace(record, indices=indices, user_groups=groups)


class UserDPDataLoader(DPDataLoader):
    """A DataLoader of user-level Poisson batches (`UserPoissonBatchSampler`);
    `batch_user_groups()` is the user position of each row of the batch handed out last.

    Its collate function must keep the rows in the order of the examples it receives, or report
    their order (`dptrain.data.row_order`: a `SortingCollate` for packed sequences); any other
    is refused with PrivacyError, since a row's user would be unknown."""

    def __init__(self, dataset: Dataset, groups: list[Tensor], sample_rate: float, *,
                 max_examples_per_user: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 **loader_kwargs: Any) -> None:
        sampler = UserPoissonBatchSampler(groups, sample_rate, max_examples_per_user, steps=steps,
                                          generator=generator, secure=secure,
                                          sample_rate_schedule=sample_rate_schedule)
        self._init_loader(dataset, sampler, row_order_collate(collate_fn), loader_kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        if reports_row_order(self.collate_fn.collate_fn):  # type: ignore[attr-defined]
            return _RowOrderIterator(batches, self.poisson_sampler)  # type: ignore[arg-type]
        return batches

    def batch_user_groups(self) -> Tensor | None:
        """Tensor[B] int64: the user position (0 .. U-1) of each row of the batch most recently
        handed to the loop, in the order of its collated rows (each user's rows contiguous unless
        the collate function reordered them); None before the first."""
        return self.poisson_sampler.handed_out_groups  # type: ignore[attr-defined]

    @classmethod
    def from_user_ids(cls, data_loader: DataLoader, user_ids: Tensor | Sequence[Any], *,
                      max_examples_per_user: int | None = None,
                      generator: torch.Generator | None = None, secure: bool = False,
                      sample_rate_schedule: Callable[[int], float] | None = None
                      ) -> UserDPDataLoader:
        """A user-level loader over `data_loader`'s dataset (its workers and collate kept), with
        q = data_loader.batch_size / N_users: `batch_size` counts users."""
        groups = user_groups(user_ids, dataset_size(data_loader))
        rate = user_sample_rate(data_loader, len(groups))
        return cls(data_loader.dataset, groups, rate, max_examples_per_user=max_examples_per_user,
                   generator=generator, secure=secure, sample_rate_schedule=sample_rate_schedule,
                   collate_fn=data_loader.collate_fn, **_loader_kwargs(data_loader))


class _RowOrderIterator:
    """A user-level loader's iterator whose collate function reports its row order: each
    `RowOrderedBatch` is unwrapped (the loop gets the batch alone) and the handed-out batch's
    user positions are put in the order of its rows."""

    def __init__(self, iterator: Iterator[Any], sampler: UserPoissonBatchSampler) -> None:
        self._iterator, self._sampler = iterator, sampler

    def __iter__(self) -> _RowOrderIterator:
        return self

    def __next__(self) -> Any:
        ordered = next(self._iterator)   # hands the batch out: the sampler records its users
        self._sampler.reorder_handed_out(ordered.order)
        return ordered.batch

    def __len__(self) -> int:
        return len(self._iterator)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def user_fingerprint(data_loader: Any) -> str | None:
    """The `assignment_fingerprint` of a user-level loader's sampler; None for any other loader
    (example level: each row is its own unit, nothing beside the records to compare)."""
    sampler = getattr(data_loader, "batch_sampler", None)
    return (sampler.assignment_fingerprint() if isinstance(sampler, UserPoissonBatchSampler)
            else None)


def user_sample_rate(data_loader: DataLoader, num_users: int) -> float:
    """q = batch_size / N_users (batch_size: the expected users per batch); ConfigError unless
    the loader has a batch_size between 1 and N_users."""
    batch = getattr(data_loader, "batch_size", None)
    if batch is None or not 1 <= batch <= num_users:
        raise ConfigError(f"with privacy_unit='user' the data loader's batch_size ({batch}) is the "
                          f"expected number of users per batch and must be between 1 and the "
                          f"{num_users} users (train.batch_size): lower it.")
    return check_sample_rate(batch / num_users, "batch_size / N_users")
