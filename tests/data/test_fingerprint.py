"""The training data's fingerprint: a hash of the stored records, in order, that changes with any
one element and never with a transform's randomness."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.base import ArrayDataset
from dptrain.data.fingerprint import UNKNOWN, data_fingerprint


def _records(n: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [n, 3, 4, 4] and int64 labels [n], the same on every call."""
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (n, 3, 4, 4), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (n,), generator=g))


class RandomFlip:
    """A random augmentation (batch transform): what must not reach the fingerprint."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) if torch.rand(()) < 0.5 else x


class Items(Dataset):
    """A map-style dataset without stored tensors, torchvision style (`transform` attribute)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, transform=None) -> None:
        self.x, self.y, self.transform = x, y, transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        image = self.x[i].numpy()
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.y[i])


def test_the_same_records_give_the_same_fingerprint() -> None:
    x, y = _records()
    fingerprint = data_fingerprint(ArrayDataset(x, y))
    assert fingerprint == data_fingerprint(ArrayDataset(x.clone(), y.clone()))
    assert len(fingerprint) == 64


def test_one_changed_element_of_one_record_changes_the_fingerprint() -> None:
    x, y = _records()
    pixel, label = x.clone(), y.clone()
    pixel[7, 1, 2, 3] ^= 1
    label[7] = (label[7] + 1) % 10
    fingerprints = {data_fingerprint(ArrayDataset(a, b))
                    for a, b in ((x, y), (pixel, y), (x, label))}
    assert len(fingerprints) == 3


def test_the_order_of_the_records_matters() -> None:
    x, y = _records()
    swapped = torch.arange(len(y))
    swapped[[3, 4]] = swapped[[4, 3]]
    reordered = ArrayDataset(x[swapped], y[swapped])
    assert data_fingerprint(ArrayDataset(x, y)) != data_fingerprint(reordered)


def test_a_random_transform_does_not_change_the_fingerprint_of_stored_records() -> None:
    x, y = _records()
    augmented = ArrayDataset(x, y, RandomFlip())
    assert data_fingerprint(augmented) == data_fingerprint(ArrayDataset(x, y))


def test_tensor_datasets_subsets_and_concatenations_hash_their_records() -> None:
    x, y = _records()
    whole = TensorDataset(x, y)
    assert data_fingerprint(whole) == data_fingerprint(TensorDataset(x.clone(), y.clone()))
    assert data_fingerprint(Subset(whole, [1, 2])) != data_fingerprint(Subset(whole, [2, 1]))
    changed = x.clone()
    changed[1, 0, 0, 0] ^= 1
    other = TensorDataset(changed, y)
    assert data_fingerprint(Subset(whole, [1])) != data_fingerprint(Subset(other, [1]))
    assert data_fingerprint(ConcatDataset([whole, whole])) != data_fingerprint(whole)


def test_a_dataset_without_stored_tensors_is_unknown_unless_its_items_may_be_read() -> None:
    x, y = _records()
    assert data_fingerprint(Items(x, y)) == UNKNOWN
    assert data_fingerprint(Items(x, y), read_items=True) != UNKNOWN


def test_items_are_read_with_their_transform_off_and_the_global_random_states_kept() -> None:
    x, y = _records()

    def noisy(image: np.ndarray) -> np.ndarray:
        return image + np.random.randint(0, 2, image.shape).astype(image.dtype)

    flipping = Items(x, y, transform=noisy)   # a new value on every read
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first = data_fingerprint(flipping, read_items=True)
    assert first == data_fingerprint(flipping, read_items=True) == \
        data_fingerprint(Items(x, y), read_items=True)
    assert flipping.transform is noisy
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]
    changed = y.clone()
    changed[0] += 1
    assert data_fingerprint(Items(x, changed), read_items=True) != first


def test_items_of_a_type_it_cannot_hash_make_the_fingerprint_unknown() -> None:
    class Objects(Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> object:
            return object()

    assert data_fingerprint(Objects(), read_items=True) == UNKNOWN
    assert data_fingerprint(None) == UNKNOWN


def test_every_embedded_and_synthetic_dataset_the_command_builds_has_a_known_fingerprint() -> None:
    for splits in (load_dataset("digits"), load_dataset("digits", synthetic=True)):
        assert data_fingerprint(splits.train) != UNKNOWN
    assert data_fingerprint(load_dataset("digits").train) == \
        data_fingerprint(load_dataset("digits").train)
