"""IMDb from aclImdb folders and the .tar.gz archive written by the test; tokenizer and vocabulary."""

import io
import tarfile

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.data.datasets.imdb import PAD, START, UNKNOWN, build_vocabulary, encode, tokenize
from dptrain.errors import ConfigError

REVIEWS = {
    ("train", "pos"): ["A great, great film.<br />Loved it!", "great acting and a great plot"],
    ("train", "neg"): ["Awful film. Boring plot", "boring, BORING"],
    ("test", "pos"): ["great fun unseen words"],
    ("test", "neg"): ["awful awful"],
}


def write_acl_imdb(root):
    for (split, label), texts in REVIEWS.items():
        folder = root / "aclImdb" / split / label
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_7.txt").write_text(text, encoding="utf-8")


def write_archive(root):
    with tarfile.open(root / "aclImdb_v1.tar.gz", "w:gz") as tar:
        for (split, label), texts in REVIEWS.items():
            for i, text in enumerate(texts):
                data = text.encode("utf-8")
                info = tarfile.TarInfo(f"aclImdb/{split}/{label}/{i}_7.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


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


def test_encoding_starts_with_the_start_id_maps_unknown_words_and_pads_with_zero():
    ids = encode(["a", "zzz"], {"a": 4}, max_len=5)
    assert ids.tolist() == [START, 4, UNKNOWN, PAD, PAD]


def test_encoding_cuts_long_reviews_to_max_len():
    assert encode(["a"] * 10, {"a": 4}, max_len=3).tolist() == [START, 4, 4]


def test_imdb_folder_gives_labelled_fixed_length_token_ids(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, max_len=8)
    assert len(splits.train) == 4 and len(splits.test) == 2
    assert sorted(splits.train.labels.tolist()) == [0, 0, 1, 1]
    assert splits.train.features.shape == (4, 8) and splits.train.features.dtype == torch.int64
    assert bool((splits.train.features[:, 0] == START).all())


def test_imdb_vocabulary_comes_from_the_training_split_only(tmp_path):
    write_acl_imdb(tmp_path)
    splits = load_dataset("imdb", root=tmp_path, max_len=6)
    fun_review = splits.test.features[splits.test.labels == 1][0]
    # "great" is the most frequent training word (id 4); "fun", "unseen", "words" never occur in training.
    assert fun_review.tolist() == [START, 4, UNKNOWN, UNKNOWN, UNKNOWN, PAD]


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
