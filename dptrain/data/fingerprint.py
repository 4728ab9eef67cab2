"""The fingerprint of a training set's contents: a SHA-256 of its stored records, in order.

Two runs over the same records (same values, same labels, same order) get the same fingerprint;
changing one element of one record, or reordering the records, changes it. A resume compares it
with the fingerprint of the data the replayed steps were computed on (dptrain.train.replay).

What is hashed is the data as stored, never an item passed through a transform (a random
augmentation would give a new fingerprint on every call):

- `ArrayDataset` (every dataset the `dptrain` command builds): its stored `features` and `labels`
  tensors (uint8 pixels, int32 token ids); its batch transform is part of the config;
- `TensorDataset`: its tensors; `Subset`: its indices and its dataset; `ConcatDataset`: its parts;
- any other map-style dataset, only when `read_items` is true: `dataset[i]` for every i, with its
  `transform`, `target_transform` and `transforms` attributes set to None during the pass and
  torch's, numpy's and python's global random states restored afterwards. Items must be tensors,
  numpy arrays, numbers, strings, bytes, PIL images, or tuples, lists and dicts of them.

Anything else (an iterable dataset, an item of another type, a reading error) is `UNKNOWN`, which
never matches: a replay over it is treated as a new computation. The cost is one pass over the
stored bytes (SHA-256: 0.16 s for 50,000 images of 3x32x32 uint8, under 1 ms for the embedded
digits), or item by item one read of every record (2.6 s for the same 50,000 images as numpy
arrays).

A user-level run (privacy_unit="user") computes over more than the records: which rows form each
user, the users' order (the sampler's coin for user u goes to the u-th group) and the cap on a
sampled user's examples. `user_assignment_fingerprint` hashes exactly those (the sampler's groups
and `max_examples_per_user`); the ledger records it beside the data's (`dataset.user_fingerprints`)
and a resume compares both. The user ids themselves are not hashed: renaming every user keeps the
groups, hence the computation, the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from dptrain.data.datasets.base import ArrayDataset

UNKNOWN = "unknown"   # a dataset whose contents could not be hashed: never the same as another
TRANSFORM_ATTRIBUTES = ("transform", "target_transform", "transforms")


class _Unhashable(Exception):
    """An item or dataset whose contents this module cannot hash deterministically."""


def data_fingerprint(dataset: Any, read_items: bool = False) -> str:
    """SHA-256 (hex) of `dataset`'s records in order (see the module docstring), or `UNKNOWN`.

    `read_items` allows the item-by-item pass over a dataset that holds no stored tensors (one
    `dataset[i]` per record: as slow as reading the data once)."""
    digest = hashlib.sha256()
    try:
        _hash_dataset(digest, dataset, read_items)
    except _Unhashable:
        return UNKNOWN
    return digest.hexdigest()


def user_assignment_fingerprint(groups: Sequence[torch.Tensor],
                                max_examples_per_user: int | None) -> str:
    """SHA-256 (hex) of what user-level sampling and clipping compute over besides the records:
    `groups` (the example indices of each user, in the sampler's user order: int64 `Tensor[n_u]`,
    `dptrain.data.user_sampling.user_groups`) and the cap `max_examples_per_user` (None: all).

    Moving one example to another user, reordering the users or changing the cap changes it."""
    digest = hashlib.sha256()
    _tag(digest, f"users {len(groups)} max_examples_per_user {max_examples_per_user!r}")
    _hash_value(digest, torch.tensor([len(rows) for rows in groups], dtype=torch.int64))
    _hash_value(digest, torch.cat([torch.as_tensor(rows, dtype=torch.int64) for rows in groups])
                if groups else torch.zeros(0, dtype=torch.int64))
    return digest.hexdigest()


def _hash_dataset(digest: Any, dataset: Any, read_items: bool) -> None:
    """Feed `dataset`'s stored records to `digest`; _Unhashable when they cannot be read."""
    if isinstance(dataset, ArrayDataset):
        _tag(digest, "array")
        _hash_value(digest, dataset.features)
        _hash_value(digest, dataset.labels)
    elif isinstance(dataset, TensorDataset):
        _tag(digest, f"tensors{len(dataset.tensors)}")
        for tensor in dataset.tensors:
            _hash_value(digest, tensor)
    elif isinstance(dataset, Subset):
        _tag(digest, "subset")
        _hash_value(digest, torch.as_tensor(list(dataset.indices), dtype=torch.int64))
        _hash_dataset(digest, dataset.dataset, read_items)
    elif isinstance(dataset, ConcatDataset):
        _tag(digest, f"concat{len(dataset.datasets)}")
        for part in dataset.datasets:
            _hash_dataset(digest, part, read_items)
    elif read_items and isinstance(dataset, Dataset) and hasattr(dataset, "__len__"):
        _hash_items(digest, dataset)
    else:
        raise _Unhashable(type(dataset).__name__)


def _hash_items(digest: Any, dataset: Any) -> None:
    """Every `dataset[i]`, transforms off and the global random states left as they were."""
    _tag(digest, f"items{len(dataset)}")
    with _transforms_off(dataset), _random_states_kept():
        for index in range(len(dataset)):
            try:
                item = dataset[index]
            except Exception as error:   # a dataset that cannot be read without its transform
                raise _Unhashable(f"dataset[{index}]: {type(error).__name__}") from error
            _hash_value(digest, item)


@contextlib.contextmanager
def _transforms_off(dataset: Any) -> Iterator[None]:
    """`dataset`'s transform attributes (TRANSFORM_ATTRIBUTES) set to None, then restored."""
    saved = {name: getattr(dataset, name) for name in TRANSFORM_ATTRIBUTES
             if getattr(dataset, name, None) is not None}
    try:
        for name in saved:
            setattr(dataset, name, None)
        yield
    finally:
        for name, value in saved.items():
            setattr(dataset, name, value)


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """torch's (CPU), numpy's and python's global random states restored on exit: reading the
    items must not shift the randomness of the training that follows."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _tag(digest: Any, text: str) -> None:
    """A length-prefixed marker: the structure is part of what is hashed, so that no two
    different sequences of values feed the digest the same bytes."""
    data = text.encode("utf-8")
    digest.update(len(data).to_bytes(8, "little") + data)


def _hash_value(digest: Any, value: Any) -> None:
    """Feed one record (or part of one) to `digest`: its type, shape, dtype and bytes."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise _Unhashable(f"a {value.layout} tensor")
        flat = value.detach().cpu().contiguous().reshape(-1)
        _tag(digest, f"tensor {value.dtype} {tuple(value.shape)}")
        digest.update(flat.view(torch.uint8).numpy().data)   # no copy when already contiguous
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise _Unhashable("a numpy array of objects")
        _tag(digest, f"ndarray {value.dtype.str} {value.shape}")
        digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
    elif isinstance(value, (bool, int, float, complex, str, np.generic)) or value is None:
        _tag(digest, f"{type(value).__name__} {value!r}")
    elif isinstance(value, (bytes, bytearray)):
        _tag(digest, f"bytes {len(value)}")
        digest.update(bytes(value))
    elif isinstance(value, (tuple, list)):
        _tag(digest, f"sequence {len(value)}")
        for part in value:
            _hash_value(digest, part)
    elif isinstance(value, dict):
        _tag(digest, f"dict {len(value)}")
        for key in sorted(value, key=repr):
            _hash_value(digest, key)
            _hash_value(digest, value[key])
    elif callable(getattr(value, "tobytes", None)) and hasattr(value, "mode"):   # a PIL image
        _tag(digest, f"image {value.mode} {tuple(value.size)}")
        digest.update(value.tobytes())
    else:
        raise _Unhashable(type(value).__name__)
