"""IMDb from aclImdb folders and the .tar.gz archive written by the test; tokenizer and the
vocabularies (hashing, the default, and the flagged train_counts)."""

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.imdb import (
    PAD,
    START,
    UNKNOWN,
    HashingVocabulary,
    build_vocabulary,
    encode,
    tokenize,
)
from dptrain.errors import ConfigError

from tests.data.datasets.on_disk import write_acl_imdb, write_archive


def test_tokenizer_lowercases_strips_line_breaks_and_splits_on_non_word_characters():
    assert tokenize("A great, great film.<br />Loved it!") == [
        "a",
        "great",
        "great",
        "film",
        "loved",
        "it",
    ]


def test_vocabulary_keeps_the_most_frequent_words_numbered_after_4_reserved_ids():
    vocab = build_vocabulary([["b", "a", "b"], ["c", "a", "b"]], vocab_size=2)
    assert vocab == {"b": 4, "a": 5}


def test_encoding_starts_with_the_start_id_maps_unknown_words_and_pads_in_front_with_zero():
    ids = encode(["a", "zzz"], {"a": 4}, max_len=5)
    assert ids.tolist() == [PAD, PAD, START, 4, UNKNOWN]


def test_encoding_keeps_the_last_max_len_ids_of_a_long_review():
    assert encode(["a"] * 9 + ["b"], {"a": 4, "b": 5}, max_len=3).tolist() == [4, 4, 5]


def test_imdb_folder_gives_labelled_fixed_length_token_ids(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, max_len=8)
    assert len(splits.train) == 4 and len(splits.test) == 2
    assert sorted(splits.train.labels.tolist()) == [0, 0, 1, 1]
    assert splits.train.features.shape == (4, 8) and splits.train.features.dtype == torch.int64
    assert bool((splits.train.features[:, -1] != PAD).all())
    assert all(START in row.tolist() for row in splits.train.features)


def test_imdb_train_counts_vocabulary_comes_from_the_training_split_only(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, max_len=6, vocabulary="train_counts")
    fun_review = splits.test.features[splits.test.labels == 1][0]
    # "great" is the most frequent training word (id 4); "fun", "unseen", "words" never occur in training.
    assert fun_review.tolist() == [PAD, START, 4, UNKNOWN, UNKNOWN, UNKNOWN]


def test_imdb_vocab_size_limits_the_word_ids(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, vocab_size=2, max_len=16)
    assert int(splits.train.features.max()) <= 5


def test_imdb_archive_reads_like_the_extracted_folder(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "archive").mkdir()
    write_acl_imdb(tmp_path / "folder")
    write_archive(tmp_path / "archive")
    from_folder = load_dataset("imdb", root=tmp_path / "folder", max_len=10)
    from_archive = load_dataset("imdb", root=tmp_path / "archive", max_len=10)
    assert torch.equal(from_folder.train.features, from_archive.train.features)
    assert torch.equal(from_folder.test.labels, from_archive.test.labels)


def test_imdb_missing_offline_names_the_path_and_the_download_flag(tmp_path):
    with pytest.raises(ConfigError, match="dataset.download=true") as error:
        load_dataset("imdb", root=tmp_path)
    assert "aclImdb" in str(error.value)



def test_hashing_vocabulary_ids_are_fixed_numbers_after_the_reserved_ones():
    vocab = HashingVocabulary(10_000)
    # CRC-32 values, the same in every process (Python's salted hash() would not be).
    assert [vocab.get(w, UNKNOWN) for w in ("great", "film", "zyzzyva")] == [9955, 3206, 1561]
    words = tokenize("every word gets one of the vocab_size ids after the reserved ones")
    assert {HashingVocabulary(3).get(w, UNKNOWN) for w in words} == {4, 5, 6}


def _encodings_before_and_after_one_review_gains_a_rare_word(tmp_path, **options):
    """(before, after) splits of the test reviews, `after` with the training review neg/1_7.txt
    (row 1: negatives come first, in file order) extended by a word no other review holds."""
    write_acl_imdb(tmp_path / "before")
    write_acl_imdb(tmp_path / "after")
    review = tmp_path / "after" / "aclImdb" / "train" / "neg" / "1_7.txt"
    review.write_text(review.read_text(encoding="utf-8") + " aardvark", encoding="utf-8")
    before = load_dataset("imdb", root=tmp_path / "before", max_len=12, **options)
    after = load_dataset("imdb", root=tmp_path / "after", max_len=12, **options)
    return before, after


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return [i for i in range(len(before)) if not torch.equal(before[i], after[i])]


def test_one_training_review_cannot_change_the_encoding_of_any_other_review(tmp_path):
    before, after = _encodings_before_and_after_one_review_gains_a_rare_word(tmp_path)
    assert _changed_rows(before.train.features, after.train.features) == [1]
    assert torch.equal(before.test.features, after.test.features)
    assert before.private_preprocessing == ()


def test_train_counts_vocabulary_lets_one_review_change_the_others_and_is_flagged(tmp_path):
    before, after = _encodings_before_and_after_one_review_gains_a_rare_word(
        tmp_path, vocabulary="train_counts")
    assert _changed_rows(before.train.features, after.train.features) != [1]
    (step,) = before.private_preprocessing
    assert "dataset.vocabulary=train_counts" in step and "epsilon does not cover" in step


def test_the_private_preprocessing_flag_survives_max_samples_and_a_validation_split(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, vocabulary="train_counts", max_samples=3,
                          validation_size=1)
    vocabulary, cap, split = splits.private_preprocessing   # each step that read the reviews
    assert vocabulary.startswith("dataset.vocabulary=train_counts") and len(splits.validation) == 1
    assert cap.startswith("dataset.max_samples=3") and split.startswith("dataset.validation_size=1")


def test_an_unknown_vocabulary_is_refused_naming_the_key_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="dataset.vocabulary='counts'.*hashing.*train_counts"):
        load_dataset("imdb", root=tmp_path, synthetic=True, vocabulary="counts")
