"""Non-finite inputs are refused when a dataset is built, naming the file (or dataset) and the
row, never met during training (where the failing step would reveal that the example was
sampled): the one check is dptrain.data.datasets.base.refuse_non_finite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.base import ArrayDataset, DatasetSplits
from dptrain.errors import ConfigError
from tests.hf_tiny import review_rows, save_tiny, write_csv


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny(tmp_path_factory.mktemp("tok") / "bert", "bert"))


def test_a_csv_with_an_empty_text_cell_is_refused_naming_the_file_and_row(bert,
                                                                          tmp_path: Path) -> None:
    """(A cell reading "NaN" is the word: test_words_pandas_reads_as_missing_stay_text.)"""
    rows = review_rows(6)
    rows[3]["review"] = ""
    path = write_csv(tmp_path / "reviews.csv", rows)
    with pytest.raises(ConfigError, match=rf"dataset.text_column: dataset.train_file={path} has 1 "
                                          r"empty cell.* data row\(s\) 4 .* fill those cells or "
                                          r"remove their rows"):
        load_dataset("text", tokenizer=bert, train_file=str(path), text_column="review")


def test_a_csv_with_an_infinite_feature_is_refused_naming_the_file_and_row(bert,
                                                                           tmp_path: Path) -> None:
    rows = [{"review": value, "label": i % 2} for i, value in enumerate([1.5, 2.0, "inf", 0.5])]
    path = write_csv(tmp_path / "numbers.csv", rows)
    with pytest.raises(ConfigError, match=rf"{path}: data row 3, column 'review', holds a NaN or "
                                          "infinite value"):
        load_dataset("text", tokenizer=bert, train_file=str(path), text_column="review")


def test_a_test_file_with_a_nan_cell_is_refused_naming_it(bert, tmp_path: Path) -> None:
    train = write_csv(tmp_path / "train.csv", review_rows(4))
    rows = review_rows(3)
    rows[0]["review"] = ""
    test = write_csv(tmp_path / "test.csv", rows)
    with pytest.raises(ConfigError, match=rf"dataset.test_file={test} has 1 empty cell.*data row\(s\) 1 "):
        load_dataset("text", tokenizer=bert, train_file=str(train), test_file=str(test),
                     text_column="review")


def test_dataset_splits_with_a_non_finite_feature_are_refused_naming_the_dataset_and_row() -> None:
    features = torch.zeros(5, 2, 3)
    features[3, 1, 2] = math.inf
    train = ArrayDataset(features, torch.zeros(5))
    test = ArrayDataset(torch.zeros(2, 2, 3), torch.zeros(2))
    with pytest.raises(ConfigError, match=r"dataset 'tabular' \(train split\): example 3 "
                                          r"\(0-based\) holds a NaN or infinite value"):
        DatasetSplits("tabular", train, test, num_classes=2)


def test_integer_features_and_finite_files_pass(bert, tmp_path: Path) -> None:
    splits = load_dataset("text", tokenizer=bert, text_column="review",
                          train_file=str(write_csv(tmp_path / "ok.csv", review_rows(5))))
    assert len(splits.train) == 5
    DatasetSplits("ids", ArrayDataset(torch.arange(6).view(3, 2), torch.zeros(3)),
                  ArrayDataset(torch.zeros(1, 2), torch.zeros(1)), num_classes=2)
