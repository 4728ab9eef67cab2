"""Which example each row of a collated batch holds: the collate functions user level accepts.

User-level clipping (`dptrain.privacy.user_level`) averages the per-example gradients of each
user, so it must know the user of every row of the batch the model ran on. The sampler knows the
user of each index it drew, in the order it drew them; the DataLoader hands the collate function
the examples in that order, and the collate function builds the rows. A collate function that
reorders them (sorting by length for `pack_padded_sequence(enforce_sorted=True)`) would make the
sampler's record name the wrong user for a row: one user's examples would be averaged with
another's and clipped as neither (one user with 5 examples then moved the noise-free clipped sum
by 2.0 C and 2.8 C in tests/privacy/test_user_level_crossings.py, not the promised C).

No test of a collate function's output can tell its row order in general (the rows are padded,
packed, tokenised), so the collate function says it, and a user-level loader accepts only:

- torch's `default_collate` (the DataLoader's default), which keeps the order;
- a function wrapped in `keeps_row_order(fn)`: the caller's word that row i of `fn(items)` is
  built from items[i] alone;
- a collate function with a `collate_with_order(items)` method returning a (batch, order) pair
  (a `RowOrderedBatch`, or any pair: order[r] is the position in `items` of row r's example),
  which reports where each row came from. `SortingCollate(key, collate_fn)` is one: it sorts the
  items by `key` (longest first for packed sequences), runs `collate_fn` on the sorted items and
  reports the permutation. Called as a plain function (a test loader, an example-level run) it
  returns the collated batch alone.

Anything else is refused with a PrivacyError naming the fix (`row_order_collate`). Example-level
runs accept every collate function: each row is clipped on its own, in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import default_collate

from dptrain.errors import PrivacyError

Collate = Callable[[list[Any]], Any]


class RowOrderedBatch(NamedTuple):
    """A collated batch and the example each of its rows holds: row r was built from
    items[order[r]] of the list the collate function received (`order`: int64 Tensor[B], a
    permutation of range(B)). A NamedTuple, so that it crosses worker processes and pinned
    memory whole and an empty batch keeps its structure (`sampling._empty_like`)."""

    batch: Any
    order: Tensor


class KeepsRowOrder:
    """A collate function declared to keep row order (see `keeps_row_order`)."""

    def __init__(self, collate_fn: Collate) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        return self.collate_fn(items)

    def __repr__(self) -> str:
        return f"keeps_row_order({_name(self.collate_fn)})"


def keeps_row_order(collate_fn: Collate) -> KeepsRowOrder:
    """`collate_fn`, declared to build row i of its batch from items[i] alone (padding, stacking,
    tokenising in order), so that a user-level loader accepts it. Wrap it where it is passed:
    `DataLoader(..., collate_fn=keeps_row_order(pad))`. Declaring a collate function that
    reorders rows breaks the user-level bound; use `SortingCollate` for one that sorts."""
    return KeepsRowOrder(collate_fn)


class SortingCollate:
    """Sort a batch's items by `key` (descending by default: longest first, as
    `pack_padded_sequence(enforce_sorted=True)` needs; ties keep their order), then collate them
    with `collate_fn` (torch's `default_collate` when None), which must keep the sorted order.

    Args:
        key: fn(item) -> a sortable value (a sequence's length).
        collate_fn: the order-keeping collate of the sorted items.
        descending: largest key first.
    """

    def __init__(self, key: Callable[[Any], Any], collate_fn: Collate | None = None,
                 descending: bool = True) -> None:
        self.key, self.collate_fn, self.descending = key, collate_fn or default_collate, descending

    def collate_with_order(self, items: Sequence[Any]) -> RowOrderedBatch:
        """The sorted, collated batch and, per row, the position in `items` of its example."""
        order = sorted(range(len(items)), key=lambda i: self.key(items[i]),
                       reverse=self.descending)   # Python's sort is stable, reversed too
        return RowOrderedBatch(self.collate_fn([items[i] for i in order]),
                               torch.tensor(order, dtype=torch.int64))

    def __call__(self, items: Sequence[Any]) -> Any:
        return self.collate_with_order(items).batch

    def __repr__(self) -> str:
        return f"SortingCollate({_name(self.key)}, {_name(self.collate_fn)})"


class _ReportingCollate:
    """A collate function with `collate_with_order`, called so that it reports its order: what
    a user-level loader runs (in the worker processes too); the loader's iterator unwraps the
    `RowOrderedBatch` before the training loop sees it."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> RowOrderedBatch:
        batch, order = self.collate_fn.collate_with_order(items)   # any (batch, order) pair
        return RowOrderedBatch(batch, torch.as_tensor(order, dtype=torch.int64))


def reports_row_order(collate_fn: Any) -> bool:
    """Whether `collate_fn` returns, for a user-level loader, a `RowOrderedBatch`."""
    return isinstance(collate_fn, _ReportingCollate)


def row_order_collate(collate_fn: Collate | None, argument: str = "collate_fn") -> Collate | None:
    """The collate function a user-level loader runs for `collate_fn`: itself when it keeps row
    order (None, torch's `default_collate`, `keeps_row_order(fn)`), a reporting wrapper when it
    has `collate_with_order` (`SortingCollate`). PrivacyError naming `argument` otherwise."""
    if collate_fn is None or collate_fn is default_collate or isinstance(collate_fn, KeepsRowOrder):
        return collate_fn
    if callable(getattr(collate_fn, "collate_with_order", None)):
        return _ReportingCollate(collate_fn)
    raise PrivacyError(
        f"privacy_unit='user' cannot use the data loader's {argument}={_name(collate_fn)}: "
        "user-level clipping must know the user of every row it averages, and a collate "
        "function that reorders the examples it receives (sorting them by length for "
        "pack_padded_sequence) would make the sampler's record name the wrong user for a row, "
        "breaking the bound of C per user. If it builds row i from the i-th example it receives, "
        "declare it: collate_fn=dptrain.data.keeps_row_order(fn). If it sorts, let dptrain sort "
        "and track the rows: collate_fn=dptrain.data.SortingCollate(key, fn) with an "
        "order-keeping fn (or give your collate a collate_with_order(items) method returning "
        "dptrain.data.RowOrderedBatch(batch, order)).")


def reorder(groups: Tensor, order: Tensor) -> Tensor:
    """`groups` (Tensor[B], one value per example in the order the collate function received
    them) in the order of the collated rows: groups[order]. PrivacyError unless `order` is a
    permutation of range(B) (a collate that drops or repeats examples)."""
    order = torch.as_tensor(order, dtype=torch.int64).cpu()
    if order.shape != groups.shape or not torch.equal(
            torch.sort(order).values, torch.arange(len(groups), dtype=torch.int64)):
        raise PrivacyError(
            f"the collate function reported a row order {order.tolist()[:10]} that is not a "
            f"permutation of the batch's {len(groups)} examples (RowOrderedBatch.order): every "
            "example must become exactly one row, so that its user is known.")
    return groups[order]


def _name(fn: Any) -> str:
    """A short name of a function or callable object, for messages."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__
