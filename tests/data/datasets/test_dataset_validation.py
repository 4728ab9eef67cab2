"""dataset.validation_size: examples held out of the training split, row by row by a keyed hash."""

from collections import Counter

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.base import ArrayDataset, DatasetSplits
from dptrain.data.datasets.selection import new_split_key
from dptrain.errors import ConfigError

KEY = bytes(range(32))


def numbered_splits(n_train: int = 20) -> DatasetSplits:
    """Training features 0..n_train-1 (each example's own index), so splits can be traced."""
    train = ArrayDataset(torch.arange(n_train).unsqueeze(1), torch.zeros(n_train))
    test = ArrayDataset(torch.arange(5).unsqueeze(1), torch.zeros(5))
    return DatasetSplits("numbered", train, test, 2)


def ids(dataset: ArrayDataset) -> list[int]:
    return dataset.features.flatten().tolist()


def rows(dataset: ArrayDataset) -> Counter:
    """The dataset's rows (features and label) as a multiset."""
    return Counter((tuple(x.tolist()), int(y)) for x, y in zip(dataset.features, dataset.labels))


def without_row(splits: DatasetSplits, row: int) -> DatasetSplits:
    """`splits` with training row `row` removed: the neighbouring file."""
    keep = torch.tensor([i for i in range(len(splits.train)) if i != row])
    return DatasetSplits(splits.name, splits.train.subset(keep), splits.test, splits.num_classes)


def changed_rows(a: ArrayDataset, b: ArrayDataset) -> Counter:
    """The rows in one training set and not the other (the multisets' symmetric difference)."""
    ra, rb = rows(a), rows(b)
    return (ra - rb) + (rb - ra)


def test_the_validation_examples_leave_the_training_split_and_nothing_is_lost():
    splits = numbered_splits().with_validation(6, KEY)
    train, validation = ids(splits.train), ids(splits.validation)
    assert len(validation) == 6 and len(train) == 14
    assert sorted(train + validation) == list(range(20))
    assert train == sorted(train) and validation == sorted(validation)  # original order kept


def test_the_split_repeats_for_a_key_and_changes_with_it_whatever_the_seed():
    first = ids(numbered_splits().with_validation(6, KEY).validation)
    assert ids(numbered_splits().with_validation(6, KEY).validation) == first
    assert ids(numbered_splits().with_validation(6, bytes(32)).validation) != first
    again = load_dataset("digits", validation_size=0.2, seed=0, split_key=KEY)
    other_seed = load_dataset("digits", validation_size=0.2, seed=7, split_key=KEY)
    assert rows(again.validation) == rows(other_seed.validation)


def test_without_a_key_each_load_draws_its_own_split_from_os_entropy_not_from_the_seed():
    first = load_dataset("digits", validation_size=0.2, seed=0)
    second = load_dataset("digits", validation_size=0.2, seed=0)
    assert first.split_key != second.split_key and len(first.split_key) == 32
    assert rows(first.validation) != rows(second.validation)
    assert "split_key" not in repr(first) and first.split_key.hex() not in repr(first)


def test_a_fraction_holds_out_each_row_with_that_probability():
    splits = load_dataset("digits", validation_size=0.25, split_key=KEY)
    n = len(splits.train) + len(splits.validation)
    held = len(splits.validation)
    assert abs(held - 0.25 * n) < 4 * (0.25 * 0.75 * n) ** 0.5   # a binomial draw, not a count


def test_zero_means_no_validation_split():
    splits = numbered_splits()
    split = splits.with_validation(0, KEY)
    assert split.validation is None and split.train is splits.train
    assert split.private_preprocessing == ()


@pytest.mark.parametrize("size", [20, 25, -1, 1.0, 0.01, 1.5, True, "0.1"])
def test_a_size_leaving_no_example_on_one_side_is_refused_naming_the_key(size):
    with pytest.raises(ConfigError, match="dataset.validation_size"):
        numbered_splits().with_validation(size, KEY)


def test_a_fraction_whose_draw_holds_out_every_row_is_refused_naming_the_key():
    # 0.95 of 20 rows rounds to 19, a valid count; some key draws all 20 rows below 0.95
    key = next(k for k in (bytes([i]) * 32 for i in range(256))
               if _held_out_all(k))
    with pytest.raises(ConfigError, match=r"dataset.validation_size=0.95.*20 were"):
        numbered_splits().with_validation(0.95, key)


def _held_out_all(key: bytes) -> bool:
    from dptrain.data.datasets.selection import VALIDATION, array_records, below, row_draws

    train = numbered_splits().train
    return bool(below(row_draws(array_records(train.features, train.labels), key, VALIDATION),
                      0.95).all())


def test_a_count_is_refused_for_rows_with_users_and_a_fraction_is_not():
    splits = numbered_splits()
    splits.train.user_ids = torch.arange(20) % 4
    with pytest.raises(ConfigError, match=r"dataset.validation_size=5 is a count.*fraction"):
        splits.with_validation(5, KEY)
    split = splits.with_validation(0.3, KEY)
    assert len(split.train.user_ids) == len(split.train)


def test_load_dataset_holds_the_validation_split_out_after_max_samples():
    splits = load_dataset("digits", max_samples=100, validation_size=10, split_key=KEY)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (90, 10, 100)
    capped = load_dataset("digits", max_samples=100, split_key=KEY)
    assert rows(splits.train) + rows(splits.validation) == rows(capped.train)


# ------------------------------------------------- neighbouring files, neighbouring training sets
# Removing one row of the file must change the training set by that row alone (a fraction: each
# row in or out by itself) or by one row (a count: that row, or the one taking its place in the
# validation split). A permutation seeded with the published train.seed changed 455 rows of the
# digits' training set (validation_size=0.2, seed 0, row 0 removed).
@pytest.mark.parametrize("row", [0, 1, 700, 1441])
def test_removing_one_row_changes_the_training_set_by_at_most_that_row(row):
    whole = load_dataset("digits", split_key=KEY)
    removed = rows(whole.train.subset(torch.tensor([row])))
    full = whole.with_validation(0.2, KEY)
    neighbour = without_row(whole, row).with_validation(0.2, KEY)
    changed = changed_rows(full.train, neighbour.train)
    assert sum(changed.values()) <= 1 and set(changed) <= set(removed)
    assert rows(neighbour.train) <= rows(full.train)


@pytest.mark.parametrize("row", [0, 1, 700, 1441])
def test_removing_one_row_changes_the_training_set_after_a_validation_count_by_one_row(row):
    whole = load_dataset("digits", split_key=KEY)
    full = whole.with_validation(300, KEY)
    neighbour = without_row(whole, row).with_validation(300, KEY)
    assert len(neighbour.validation) == 300
    assert rows(neighbour.train) <= rows(full.train)           # nothing comes in
    assert sum(changed_rows(full.train, neighbour.train).values()) == 1


def test_the_ledger_sentence_names_the_split_and_the_unit_it_keeps():
    splits = load_dataset("digits", validation_size=0.2, split_key=KEY)
    (sentence,) = splits.private_preprocessing
    assert sentence.startswith(f"dataset.validation_size=0.2 held out {len(splits.validation)} "
                               f"of the 1442 training rows, each row independently")
    assert "Epsilon holds for a row of the file" in sentence and KEY.hex() not in sentence
