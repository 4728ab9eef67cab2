"""dataset=text / glue_sst2 / e2e_nlg: rows tokenised with the model's tokenizer.

No download happens here: the hub datasets are exercised with `datasets.load_dataset` replaced
by an in-memory DatasetDict of the hub's columns.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from dptrain.data.datasets import load_dataset
from dptrain.errors import ConfigError
from dptrain.data.datasets.text import unpack_rows
from tests.hf_tiny import e2e_rows, review_rows, save_tiny, write_csv

GPT2 = {"pad_token": "<|endoftext|>"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tok")
    return {kind: str(save_tiny(root / kind, kind)) for kind in ("bert", "gpt2", "llama")}


def _reviews(tmp_path: Path, count: int = 6) -> Path:
    return write_csv(tmp_path / "reviews.csv", review_rows(count))


def test_each_csv_row_is_one_example_of_ids_mask_and_label(tokenizers: dict[str, str],
                                                          tmp_path: Path) -> None:
    splits = load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(_reviews(tmp_path, 7)),
                          text_column="review", max_len=10)
    item = splits.train[1]
    ids, mask, y = item["input_ids"], item["attention_mask"], item["labels"]
    assert sorted(item) == ["attention_mask", "input_ids", "labels"]
    assert len(splits.train) == 7 and ids.shape == mask.shape == (10,)
    assert ids.dtype == mask.dtype == torch.int64
    assert int(mask.sum()) == 5 and int(y) == 1  # [CLS] i liked it [SEP]
    assert splits.num_classes == 2 and splits.info["task"] == "sequence_classification"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_json_lines_and_parquet_files_read_like_csv(tokenizers: dict[str, str], tmp_path: Path,
                                                    suffix: str) -> None:
    import pandas as pd

    frame = pd.DataFrame(review_rows(5))
    path = tmp_path / f"reviews{suffix}"
    frame.to_json(path, orient="records", lines=True) if suffix == ".jsonl" else frame.to_parquet(path)
    csv_splits = load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                              train_file=str(_reviews(tmp_path, 5)))
    splits = load_dataset("text", tokenizer=tokenizers["bert"], text_column="review", train_file=str(path))
    assert torch.equal(splits.train.features, csv_splits.train.features)
    assert torch.equal(splits.train.labels, csv_splits.train.labels)


def test_missing_text_column_names_the_columns_that_exist(tokenizers: dict[str, str],
                                                          tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset.text_column=text: .* no column 'text'\. Its "
                                          r"columns are: review, label"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(_reviews(tmp_path)))


def test_missing_label_column_names_the_columns_that_exist(tokenizers: dict[str, str],
                                                           tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset.label_column=sentiment: .* Its columns are: "
                                          r"review, label"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(_reviews(tmp_path)),
                     text_column="review", label_column="sentiment")


def test_labels_beyond_num_labels_are_refused(tokenizers: dict[str, str], tmp_path: Path) -> None:
    rows = [{"review": "i liked it", "label": 2}, {"review": "a bad movie", "label": 0}]
    with pytest.raises(ConfigError, match="dataset.num_labels=2, but .* labels from 0 to 2"):
        load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                     train_file=str(write_csv(tmp_path / "three.csv", rows)))


def test_causal_lm_labels_cover_the_text_and_its_end_token_only(tokenizers: dict[str, str],
                                                                tmp_path: Path) -> None:
    path = write_csv(tmp_path / "e2e.csv", e2e_rows(3))
    splits = load_dataset("text", tokenizer=tokenizers["gpt2"], train_file=str(path), label_column=None,
                          text_column="ref", prompt_column="mr", max_len=30, **GPT2)
    item = splits.train[0]
    ids, mask, labels = item["input_ids"], item["attention_mask"], item["labels"]
    prompt, text = len(e2e_rows(1)[0]["mr"].split()), len(e2e_rows(1)[0]["ref"].split())
    counted = labels != -100
    assert int(mask.sum()) == prompt + 1 + text + 1            # prompt [sep] text [eos]
    assert counted.nonzero().flatten().tolist() == list(range(prompt + 1, prompt + text + 2))
    assert torch.equal(labels[counted], ids[counted])
    assert splits.info["task"] == "causal_lm"


@pytest.mark.parametrize("kind, end", [("gpt2", "<|endoftext|>"), ("llama", "</s>")])
def test_causal_lm_labels_keep_the_real_end_token_when_padding_with_it(
        tokenizers: dict[str, str], tmp_path: Path, kind: str, end: str) -> None:
    """Padding with the end token (GPT-2, Llama: no pad token of their own): the text's own end
    token is trained on, the padding after it (the same id) is not; the mask tells them apart."""
    path = write_csv(tmp_path / "e2e.csv", e2e_rows(2))
    splits = load_dataset("text", tokenizer=tokenizers[kind], train_file=str(path),
                          label_column=None, text_column="ref", max_len=30, pad_token=end)
    item = splits.train[0]
    ids, mask, labels = item["input_ids"], item["attention_mask"], item["labels"]
    last = int(mask.sum()) - 1                              # the text's end token
    end_id = int(ids[last])
    assert (ids[last + 1:] == end_id).all() and bool((mask[last + 1:] == 0).all())
    assert int(labels[last]) == end_id and bool((labels[last + 1:] == -100).all())
    assert torch.equal(labels[mask == 1][1:], ids[mask == 1][1:])  # every text token after [bos]


def test_max_samples_keeps_that_many_rows(tokenizers: dict[str, str], tmp_path: Path) -> None:
    splits = load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(_reviews(tmp_path, 9)),
                          text_column="review", max_samples=4)
    assert len(splits.train) == 4


def _rows(dataset: Any) -> Counter:
    return Counter((tuple(x.tolist()), int(y)) for x, y in zip(dataset.features, dataset.labels))


@pytest.mark.parametrize("row", [0, 13, 29])
def test_removing_one_row_of_the_file_changes_its_max_samples_rows_by_at_most_one_substitution(
        tokenizers: dict[str, str], tmp_path: Path, row: int) -> None:
    lines = [{"review": f"{text} {i}", "label": i % 2}
             for i, text in enumerate(r["review"] for r in review_rows(30))]
    key = bytes(range(32))

    def load(rows: list[dict[str, object]], name: str, **options: Any) -> Any:
        return load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                            train_file=str(write_csv(tmp_path / name, rows)), split_key=key,
                            **options)

    removed = _rows(load([lines[row]], "one.csv").train)
    for options in ({"max_samples": 10}, {"validation_size": 0.3}):
        full = _rows(load(lines, "full.csv", **options).train)
        neighbour = _rows(load(lines[:row] + lines[row + 1:], "neighbour.csv", **options).train)
        left, came = full - neighbour, neighbour - full
        assert sum(left.values()) <= 1 and set(left) <= set(removed)
        assert sum(came.values()) <= (1 if "max_samples" in options else 0)


def test_hub_dataset_not_on_disk_is_not_downloaded_without_download_true(
        tokenizers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(ConfigError, match="dataset 'glue_sst2' is not on disk.*dataset.download=true"):
        load_dataset("glue_sst2", tokenizer=tokenizers["bert"], root=str(tmp_path / "sst2"))


def _fake_hub(monkeypatch: pytest.MonkeyPatch, splits: dict[str, dict[str, list[Any]]]) -> list[tuple]:
    """Replace datasets.load_dataset by an in-memory DatasetDict; returns the calls made."""
    import datasets

    calls: list[tuple] = []

    def load(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()})

    monkeypatch.setattr(datasets, "load_dataset", load)
    return calls


def test_sst2_download_saves_glue_and_tests_on_its_validation_split(
        tokenizers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = {"sentence": ["i liked it", "a bad movie", "boring plot"], "label": [1, 0, 0], "idx": [0, 1, 2]}
    validation = {"sentence": ["a great film"], "label": [1], "idx": [0]}
    calls = _fake_hub(monkeypatch, {"train": train, "validation": validation,
                                    "test": {**validation, "label": [-1]}})
    root = tmp_path / "sst2"
    splits = load_dataset("glue_sst2", tokenizer=tokenizers["bert"], root=str(root), download=True)
    again = load_dataset("glue_sst2", tokenizer=tokenizers["bert"], root=str(root))  # from disk
    assert calls[0][0] == ("nyu-mll/glue", "sst2") and len(calls) == 1
    assert (len(again.train), len(again.test)) == (3, 1) and again.test.labels.tolist() == [1]
    assert torch.equal(splits.train.features, again.train.features)


def test_e2e_download_uses_the_meaning_representation_as_prompt(
        tokenizers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = {"meaning_representation": ["name the pub"], "human_reference": ["the pub is cheap"]}
    _fake_hub(monkeypatch, {"train": pairs, "validation": pairs, "test": pairs})
    splits = load_dataset("e2e_nlg", tokenizer=tokenizers["gpt2"], root=str(tmp_path / "e2e"),
                          download=True, **GPT2)
    item = splits.train[0]
    mask, labels = item["attention_mask"], item["labels"]
    assert int((labels != -100).sum()) == 4 + 1 and int(mask.sum()) == 3 + 1 + 4 + 1


def test_synthetic_sst2_needs_no_file(tokenizers: dict[str, str]) -> None:
    splits = load_dataset("glue_sst2", tokenizer=tokenizers["bert"], synthetic=True, max_samples=16)
    assert (len(splits.train), len(splits.test)) == (16, 16) and splits.info["synthetic"]


def _reviews_by(tmp_path: Path, users: list[Any]) -> Path:
    rows = [{**row, "author": user} for row, user in zip(review_rows(len(users)), users)]
    return write_csv(tmp_path / "authored.csv", rows)


def test_a_user_column_gives_each_training_row_its_user_numbered_by_first_appearance(
        tokenizers: dict[str, str], tmp_path: Path) -> None:
    path = _reviews_by(tmp_path, ["ann", "bob", "ann", "cy", "bob", "ann"])
    splits = load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                          train_file=str(path), user_column="author")
    assert splits.train.user_ids.tolist() == [0, 1, 0, 2, 1, 0]


def test_user_ids_follow_the_rows_kept_after_a_validation_split(tokenizers: dict[str, str],
                                                               tmp_path: Path) -> None:
    users = [f"u{i % 10 % 4}" for i in range(12)]  # rows i, i + 10 hold the same text
    path = _reviews_by(tmp_path, users)
    whole = load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                         train_file=str(path), user_column="author")
    split = load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                         train_file=str(path), user_column="author", validation_size=0.3,
                         split_key=bytes(range(32)))   # a fixed draw: some rows on each side
    kept = [next(i for i in range(12) if torch.equal(whole.train.features[i], row))
            for row in split.train.features]
    assert split.train.user_ids.tolist() == whole.train.user_ids[kept].tolist()


def test_a_row_without_a_user_is_refused_naming_the_user_column(tokenizers: dict[str, str],
                                                               tmp_path: Path) -> None:
    path = _reviews_by(tmp_path, ["ann", "", "bob"])
    with pytest.raises(ConfigError, match="dataset.user_column.*1 row"):
        load_dataset("text", tokenizer=tokenizers["bert"], text_column="review",
                     train_file=str(path), user_column="author")


# A file as a user hands it over: each bad file gets one paragraph naming the key and the fix.
def test_an_empty_file_is_refused_naming_the_key(tokenizers: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"dataset.train_file=.*empty.csv is empty \(0 bytes\)"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(path))


def test_a_header_only_file_is_refused_naming_the_key(tokenizers: dict[str, str],
                                                     tmp_path: Path) -> None:
    path = tmp_path / "header.csv"
    path.write_text("text,label\n")
    with pytest.raises(ConfigError, match="dataset.train_file=.*has no rows"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(path))


def test_a_latin1_file_is_refused_with_the_conversion_to_utf8(tokenizers: dict[str, str],
                                                             tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes("text,label\ncaf\u00e9 cr\u00e8me,1\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text.*byte 0xe9.*iconv"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(path))


def test_an_empty_text_cell_is_refused_naming_its_row(tokenizers: dict[str, str],
                                                      tmp_path: Path) -> None:
    path = tmp_path / "gap.csv"
    path.write_text("text,label\ngood film,1\n,0\nbad film,0\n")
    with pytest.raises(ConfigError, match=r"dataset.text_column: .*gap.csv has 1 empty cell.*row\(s\) 2"):
        load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(path))


def test_words_pandas_reads_as_missing_stay_text(tokenizers: dict[str, str], tmp_path: Path) -> None:
    """'NA', 'null', 'None' and 'nan' are words of a review, not missing values."""
    path = write_csv(tmp_path / "words.csv", [{"text": w, "label": 1} for w in ("NA", "null", "None", "nan")])
    splits = load_dataset("text", tokenizer=tokenizers["bert"], train_file=str(path), max_len=6)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tokenizers["bert"])
    ids, _ = unpack_rows(splits.train.features)
    assert [tok.decode(row, skip_special_tokens=True) for row in ids] == \
        [tok.decode(tok(w)["input_ids"], skip_special_tokens=True) for w in ("NA", "null", "None", "nan")]


def test_a_model_folder_without_tokenizer_files_is_refused_naming_the_key(tmp_path: Path) -> None:
    """transformers would build a 5-token tokenizer there: every word read as [UNK]."""
    folder = save_tiny(tmp_path / "bert", "bert")
    for path in folder.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            path.unlink()
    with pytest.raises(ConfigError, match="dataset.tokenizer=.*holds no tokenizer.*save_pretrained"):
        load_dataset("text", tokenizer=str(folder), train_file=str(_reviews(tmp_path)),
                     text_column="review")
