"""dataset.validation_size: examples held out of the training split by a seeded split."""

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.base import ArrayDataset, DatasetSplits
from dptrain.errors import ConfigError


def numbered_splits(n_train: int = 20) -> DatasetSplits:
    """Training features 0..n_train-1 (each example's own index), so splits can be traced."""
    train = ArrayDataset(torch.arange(n_train).unsqueeze(1), torch.zeros(n_train))
    test = ArrayDataset(torch.arange(5).unsqueeze(1), torch.zeros(5))
    return DatasetSplits("numbered", train, test, 2)


def ids(dataset: ArrayDataset) -> list[int]:
    return dataset.features.flatten().tolist()


def rows(dataset: ArrayDataset) -> set[tuple[int, ...]]:
    return {tuple(row.tolist()) for row in dataset.features}


def test_the_validation_examples_leave_the_training_split_and_nothing_is_lost():
    splits = numbered_splits().with_validation(6, seed=0)
    train, validation = ids(splits.train), ids(splits.validation)
    assert len(validation) == 6 and len(train) == 14
    assert sorted(train + validation) == list(range(20))
    assert train == sorted(train) and validation == sorted(validation)  # original order kept


def test_the_split_repeats_for_a_seed_and_changes_with_it():
    first = ids(numbered_splits().with_validation(6, seed=3).validation)
    assert ids(numbered_splits().with_validation(6, seed=3).validation) == first
    assert ids(numbered_splits().with_validation(6, seed=4).validation) != first


def test_a_fraction_is_rounded_to_a_count_of_the_training_split():
    assert len(numbered_splits().with_validation(0.26, seed=0).validation) == 5


def test_zero_means_no_validation_split():
    splits = numbered_splits()
    assert splits.with_validation(0, seed=0) is splits and splits.validation is None


@pytest.mark.parametrize("size", [20, 25, -1, 1.0, 0.01, 1.5, True, "0.1"])
def test_a_size_leaving_no_example_on_one_side_is_refused_naming_the_key(size):
    with pytest.raises(ConfigError, match="dataset.validation_size"):
        numbered_splits().with_validation(size, seed=0)


def test_load_dataset_holds_the_validation_split_out_after_max_samples():
    splits = load_dataset("digits", max_samples=100, validation_size=10, seed=1)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (90, 10, 100)
    capped = load_dataset("digits", max_samples=100, seed=1)
    assert rows(splits.train) | rows(splits.validation) == rows(capped.train)
