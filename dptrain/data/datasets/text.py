"""Text datasets for pretrained language models: local files, GLUE SST-2 and E2E.

Every loader tokenises with the model's tokenizer (`tokenizer`: a folder or hub id, normally
`model.name_or_path`; `dptrain.pretrained.load_tokenizer`) to `max_len` tokens, right padded, and
returns `DatasetSplits` of `TextDataset`s. Each item (and, collated, each batch) is a mapping
`{"input_ids": [T], "attention_mask": [T], "labels": ...}` (int64; `[B, T]` once batched), the
keywords a Hugging Face model takes (`dptrain.batches`). They are stored as `features`
`[N, 2 max_len]` int32 (token ids then attention mask: `pack_rows`) with N the number of rows
(examples), never of tokens: the layout the data fingerprint (dptrain.data.fingerprint), the
validation split and the `max_samples` cap hash, kept so that a run's fingerprint, hence its
resume, is unchanged:

* classification (`info["task"] == "sequence_classification"`): labels `[N]` in
  `[0, num_labels)`; the tokenizer's own special tokens ([CLS] ... [SEP]) are added;
* causal LM (`info["task"] == "causal_lm"`): labels `[N, max_len]`, the token ids with -100 at
  padding and at prompt tokens, so that a sample's loss covers only its own text. A row is
  `[bos] text [eos]` (`[bos]` when the tokenizer has one), or `prompt [sep] text [eos]` with a
  prompt column (E2E: the meaning representation is the prompt), `[sep]` the bos (else eos)
  token; rows longer than `max_len` are cut at the end.

`load_text`: CSV, JSON / JSON lines or Parquet files with a text column and a label column (or
`label_column=None` for a causal LM). `load_glue_sst2`, `load_e2e_nlg`: through Hugging Face
`datasets`, downloaded into `root` (`save_to_disk`) only with `download=True`, read from there
afterwards. `synthetic=True` draws seeded random sentences of the same sizes instead (no file).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from dptrain.data.datasets.base import (
    ArrayDataset,
    DatasetSplits,
    download_failed,
    refuse_non_finite,
    require_files,
)
from dptrain.data.datasets.selection import (TEST_CAP, TRAIN_CAP, cap_steps, keep_smallest,
                                             row_draws, split_key_or_new, text_records)
from dptrain.errors import ConfigError
from dptrain.losses import IGNORE_INDEX
from dptrain.batches import LABELS
from dptrain.pretrained import TASKS, load_tokenizer

CLASSIFICATION, CAUSAL_LM = TASKS
INPUT_IDS, ATTENTION_MASK = "input_ids", "attention_mask"
READERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
MAX_LISTED = 10  # column names quoted in an error
SYNTHETIC_WORDS = ("the film a movie story great bad good plot actor acting scene slow funny "
                   "boring moving dull brilliant weak strong music ending cast restaurant food "
                   "cheap expensive family friendly near centre riverside coffee shop").split()

Row = tuple[str | None, str]  # (prompt or None, text)


class AsInt64:
    """Batch transform: stored int32 `[B, 2T]` -> int64 (what embeddings take); picklable."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int64)


def pack_rows(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token ids and attention mask `[B, T]` each -> the stored (and packed) layout `[B, 2T]`."""
    return torch.cat([ids, mask], dim=1)


def unpack_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored layout `[B, 2T]` -> (ids, mask), `[B, T]` each."""
    length = x.shape[1] // 2
    return x[:, :length], x[:, length:]


class TextDataset(ArrayDataset):
    """Tokenised texts: `features` int32 `[N, 2T]` (ids then mask, `pack_rows`), `labels`
    int64 `[N]` (classes) or `[N, T]` (a causal LM's token labels, -100 where no loss counts).

    `dataset[i]` is `{"input_ids": [T], "attention_mask": [T], "labels": [] or [T]}`, int64 (the
    transform, `AsInt64`, applied to the stored rows); `__getitems__` builds a whole batch's in
    one vectorized call. The fingerprint, the validation split and the cap read `features` and
    `labels` as stored, as for every ArrayDataset."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._items(torch.as_tensor([index], dtype=torch.int64))[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:  # type: ignore[override]
        return self._items(torch.as_tensor(list(indices), dtype=torch.int64))

    def _items(self, idx: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        ids, mask = unpack_rows(self._inputs(self.features[idx]))
        return [{INPUT_IDS: i, ATTENTION_MASK: m, LABELS: y}
                for i, m, y in zip(ids.unbind(0), mask.unbind(0), self.labels[idx].unbind(0))]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """`(T,)`: the shape of one example's token ids (and of its mask)."""
        return (self.features.shape[1] // 2,)


# ----------------------------------------------------------------------------- files and tables
def read_table(path: str | Path, key: str) -> dict[str, list[Any]]:
    """column -> values of a CSV/TSV, JSON (records or lines) or Parquet file.

    Raises ConfigError naming `key` for a missing file or an unknown extension.
    """
    import pandas as pd

    file = Path(path).expanduser()
    kind = READERS.get(file.suffix.lower())
    if kind is None:
        raise ConfigError(f"{key}={path}: unknown file type {file.suffix!r}; use a .csv, .tsv, "
                          f".json, .jsonl or .parquet file.")
    if not file.is_file():
        raise ConfigError(f"{key}={path} does not exist (relative paths start at the folder "
                          f"dptrain was started from): point {key} at the file.")
    try:
        frame = _read_frame(file, kind)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{key}={path} is empty (0 bytes): point {key} at a file with a header "
                          f"line and one row per example.") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{key}={path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}); dptrain reads text files as UTF-8 so that no character is silently "
            f"changed. Re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`, or "
            f"your spreadsheet's 'CSV UTF-8' format) and point {key} at it.") from None
    if len(frame) == 0:
        raise ConfigError(f"{key}={path} has no rows (only a header, or an empty list): point "
                          f"{key} at a file with one row per example.")
    return {str(column): frame[column].tolist() for column in frame.columns}


def _read_frame(file: Path, kind: str) -> Any:
    """A pandas frame of `file`. A CSV's empty cells and words such as "NA", "null" or "nan" stay
    the text they are (pandas would turn them into NaN, which str() makes the word "nan"); the
    columns' use refuses empty cells (`present`)."""
    import pandas as pd

    if kind == "csv":
        return pd.read_csv(file, sep="\t" if file.suffix.lower() == ".tsv" else ",",
                           encoding="utf-8", keep_default_na=False)
    if kind == "json":
        return pd.read_json(file, lines=file.suffix.lower() == ".jsonl", encoding="utf-8")
    return pd.read_parquet(file)


def _missing(value: Any) -> bool:
    """An empty cell: None, NaN (JSON null, a Parquet null) or a blank string."""
    if value is None:
        return True
    if isinstance(value, float):
        return value != value
    return isinstance(value, str) and not value.strip()


def present(values: list[Any], key: str, source: str) -> list[Any]:
    """`values`, refused with a ConfigError naming `key`, the file and the row when a cell is
    empty (it would be trained as the text "nan" or "None", or as nothing)."""
    empty = [i for i, value in enumerate(values) if _missing(value)]
    if empty:
        rows = ", ".join(str(i + 1) for i in empty[:MAX_LISTED]) + (", ..." if len(empty) > MAX_LISTED else "")
        raise ConfigError(
            f"{key}: {source} has {len(empty)} empty cell(s) in that column, at data row(s) {rows} "
            f"(row 1 is the first after the header). An empty cell would be trained as the text "
            f"'nan' or as nothing: fill those cells or remove their rows from the file."
        )
    return values


def column(table: dict[str, Any], name: str, key: str, source: str) -> list[Any]:
    """`table[name]`, or a ConfigError naming `key` and listing the columns that exist."""
    if name not in table:
        found = list(table)
        listed = ", ".join(found[:MAX_LISTED]) + (", ..." if len(found) > MAX_LISTED else "")
        raise ConfigError(
            f"{key}={name}: {source} has no column {name!r}. Its columns are: {listed}. Set {key} "
            f"to one of them."
        )
    return list(table[name])


def _integer(value: Any) -> int | None:
    """`value` as an int when it is an integer (int, or a float with no fraction), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def class_labels(values: Sequence[Any], num_labels: int, source: str) -> torch.Tensor:
    """int64 `[N]` labels checked to be integers in `[0, num_labels)`."""
    labels = [_integer(value) for value in values]
    bad = next((v for v, label in zip(values, labels) if label is None), None)
    if any(label is None for label in labels):
        raise ConfigError(
            f"dataset.label_column: {source} holds the label {bad!r}; labels must be integers "
            f"0 .. dataset.num_labels - 1. Map them to integers in the file."
        )
    tensor = torch.tensor(labels, dtype=torch.int64)
    if len(tensor) and (int(tensor.min()) < 0 or int(tensor.max()) >= num_labels):
        raise ConfigError(
            f"dataset.num_labels={num_labels}, but {source} has labels from {int(tensor.min())} to "
            f"{int(tensor.max())}: set dataset.num_labels to the number of classes (labels are "
            f"0 .. num_labels - 1; it is a public setting, not read from the data)."
        )
    return tensor


# ----------------------------------------------------------------------------- tokenising
def encode_classification(tokenizer: Any, texts: Sequence[str], max_len: int) -> torch.Tensor:
    """int32 `[N, 2 max_len]`: ids (the tokenizer's special tokens added), then the attention mask."""
    if not texts:
        return torch.zeros(0, 2 * max_len, dtype=torch.int32)
    encoded = tokenizer([str(t) for t in texts], max_length=max_len, truncation=True,
                        padding="max_length", return_tensors="pt")
    return pack_rows(encoded["input_ids"], encoded["attention_mask"]).to(torch.int32)


def encode_causal_lm(tokenizer: Any, rows: Sequence[Row], max_len: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features int32 `[N, 2 max_len]`, labels int64 `[N, max_len]`) of `(prompt, text)` rows:
    labels are the ids at the text's tokens and its end token, -100 elsewhere.

    Labels and mask follow each row's positions, never token ids: with the end token as the pad
    token (GPT-2, Llama) a row's own end token keeps its label and the padding after it, the
    same id, gets -100 and mask 0."""
    eos = tokenizer.eos_token_id
    sep = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    if eos is None:
        raise ConfigError("model.task=causal_lm needs a tokenizer with an end-of-text token "
                          "(eos_token) to end each example: choose a causal LM's tokenizer.")
    ids = torch.full((len(rows), max_len), tokenizer.pad_token_id, dtype=torch.int32)
    mask = torch.zeros(len(rows), max_len, dtype=torch.int32)
    labels = torch.full((len(rows), max_len), IGNORE_INDEX, dtype=torch.int64)
    if not rows:
        return pack_rows(ids, mask), labels
    texts = tokenizer([(" " + t if p is not None else t) for p, t in rows],
                      add_special_tokens=False)["input_ids"]
    prompts = tokenizer([p or "" for p, _ in rows], add_special_tokens=False)["input_ids"]
    for i, ((prompt, _), text_ids, prompt_ids) in enumerate(zip(rows, texts, prompts)):
        head = (list(prompt_ids) + [sep]) if prompt is not None else ([sep] if sep is not None else [])
        row = (head + list(text_ids) + [eos])[:max_len]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        mask[i, : len(row)] = 1
        start = min(len(head), len(row))
        labels[i, start : len(row)] = torch.tensor(row[start:], dtype=torch.int64)
    return pack_rows(ids, mask), labels


# ----------------------------------------------------------------------------- splits
def _splits(name: str, tokenizer: Any, task: str, max_len: int, num_labels: int | None,
            parts: dict[str, tuple[list[Row], list[Any] | None]], info: dict[str, Any]
            ) -> DatasetSplits:
    """Tokenised train/test ArrayDatasets of `parts[split] = (rows, labels or None)`."""
    datasets = {}
    for split, (rows, labels) in parts.items():
        if task == CLASSIFICATION:
            features = encode_classification(tokenizer, [t for _, t in rows], max_len)
            targets = class_labels(labels or [], num_labels or 2, f"the {split} split of {name}")
        else:
            features, targets = encode_causal_lm(tokenizer, rows, max_len)
        datasets[split] = TextDataset(features, targets, AsInt64())
    classes = num_labels if task == CLASSIFICATION else len(tokenizer)
    return DatasetSplits(name, datasets["train"], datasets["test"], int(classes),
                         {"task": task, "max_len": max_len, **info})


def _cap(columns: Sequence[Sequence[Any] | None], max_samples: int | None, key: bytes,
         purpose: str) -> list[int]:
    """Indices, in file order, of at most `max_samples` rows of a table given as its `columns`
    (text, prompt, label; None: absent): those with the smallest keyed hash of their contents
    (dptrain.data.datasets.selection)."""
    rows = len(columns[0] or ())
    if max_samples is None or max_samples >= rows:
        return list(range(rows))
    return keep_smallest(row_draws(text_records(*columns), key, purpose), max_samples).tolist()


def _take(values: list[Any] | None, indices: list[int]) -> list[Any] | None:
    return None if values is None else [values[i] for i in indices]


def synthetic_rows(size: int, generator: torch.Generator, prompt: bool) -> list[Row]:
    """`size` random sentences of 4 to 24 words (with a random prompt when `prompt`)."""
    def sentence() -> str:
        length = int(torch.randint(4, 25, (1,), generator=generator))
        picks = torch.randint(len(SYNTHETIC_WORDS), (length,), generator=generator)
        return " ".join(SYNTHETIC_WORDS[i] for i in picks.tolist())

    return [(sentence() if prompt else None, sentence()) for _ in range(size)]


def _synthetic_parts(sizes: dict[str, int], task: str, num_labels: int, prompt: bool, seed: int,
                     max_samples: int | None) -> dict[str, tuple[list[Row], list[Any] | None]]:
    generator = torch.Generator().manual_seed(seed)
    parts = {}
    for split, size in sizes.items():
        size = min(size, max_samples) if max_samples is not None else size
        rows = synthetic_rows(size, generator, prompt)
        labels = torch.randint(num_labels, (size,), generator=generator).tolist() \
            if task == CLASSIFICATION else None
        parts[split] = (rows, labels)
    return parts


# The config key of a text dataset's tokenizer, as its messages name it (the command names
# model.name_or_path instead when this key follows it: dptrain.cli.build.build_dataset).
TOKENIZER_KEY = "dataset.tokenizer"


def _tokenizer(tokenizer: str | None, pad_token: str | None, download: bool) -> Any:
    if tokenizer is None:
        raise ConfigError(
            "dataset.tokenizer is null: a text dataset is tokenised with the model's tokenizer. "
            "Use model=hf (dataset.tokenizer follows model.name_or_path), or set "
            "dataset.tokenizer=FOLDER_OR_HUB_ID."
        )
    return load_tokenizer(str(tokenizer), download=download, pad_token=pad_token,
                          key=TOKENIZER_KEY)


def _check_max_len(max_len: Any) -> int:
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ConfigError(f"dataset.max_len={max_len!r} must be an integer >= 2 (tokens per example).")
    return max_len


# ----------------------------------------------------------------------------- local files
def load_text(
    *,
    train_file: str | None = None,
    test_file: str | None = None,
    text_column: str = "text",
    label_column: str | None = "label",
    prompt_column: str | None = None,
    num_labels: int = 2,
    user_column: str | None = None,
    tokenizer: str | None = None,
    pad_token: str | None = None,
    max_len: int = 128,
    synthetic: bool = False,
    download: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    root: str | None = None,
    split_key: bytes | None = None,
) -> DatasetSplits:
    """Local CSV/JSON/Parquet files: classification with a label column, causal LM without one
    (`label_column=None`; `prompt_column` then names a prompt kept out of the loss).

    `test_file=None` gives an empty test split (no test metrics). `download` only allows the
    tokenizer to be downloaded; `root` is unused (the files are named directly). `user_column`
    names the column of each row's user: the training split's `user_ids` (int64 [N], users
    numbered in order of first appearance), for user-level privacy (privacy.unit=user).
    `max_samples` keeps the rows of smallest keyed hash under `split_key` (None: a fresh key;
    dptrain.data.datasets.selection), before tokenising.
    """
    max_len = _check_max_len(max_len)
    task = CLASSIFICATION if label_column is not None else CAUSAL_LM
    if prompt_column is not None and task == CLASSIFICATION:
        raise ConfigError("dataset.prompt_column is for text-only (causal LM) data: set "
                          "dataset.label_column=null with it, or remove dataset.prompt_column.")
    tok = _tokenizer(tokenizer, pad_token, download)
    if synthetic:
        parts = _synthetic_parts({"train": 512, "test": 128}, task, num_labels,
                                 prompt_column is not None, seed, max_samples)
        return _splits("text", tok, task, max_len, num_labels, parts, {"synthetic": True})
    if train_file is None:
        raise ConfigError("dataset=text needs dataset.train_file=PATH (a .csv, .json, .jsonl or "
                          ".parquet file), or dataset.synthetic=true for random sentences.")
    parts, users, steps = {}, None, ()
    split_key = split_key_or_new(split_key)
    for split, path, purpose in (("train", train_file, TRAIN_CAP), ("test", test_file, TEST_CAP)):
        if path is None:
            parts[split] = ([], [] if task == CLASSIFICATION else None)
            continue
        key = f"dataset.{split}_file"
        table = read_table(path, key)
        source = f"{key}={path}"
        texts = present(column(table, text_column, "dataset.text_column", source),
                        "dataset.text_column", source)
        prompts = present(column(table, prompt_column, "dataset.prompt_column", source),
                          "dataset.prompt_column", source) if prompt_column is not None else None
        labels = present(column(table, label_column, "dataset.label_column", source),
                         "dataset.label_column", source) if label_column is not None else None
        for name, cells in ((text_column, texts), (prompt_column, prompts)):
            if cells is not None:  # numbers read as NaN or inf; before the cap: the file's rows
                refuse_non_finite(cells, source,
                                  lambda i, name=name: f"data row {i + 1}, column {name!r},")
        keep = _cap((texts, prompts, labels), max_samples, split_key, purpose)
        rows = [(None if prompts is None else str(prompts[i]), str(texts[i])) for i in keep]
        parts[split] = (rows, _take(labels, keep))
        if split == "train":
            steps = cap_steps(max_samples, len(keep), len(texts))
        if split == "train" and user_column is not None:
            users = _take(column(table, user_column, "dataset.user_column", source), keep)
            users = user_codes(users, source)
    splits = replace(_splits("text", tok, task, max_len, num_labels, parts, {}),
                     private_preprocessing=steps, split_key=split_key)
    if users is not None:
        splits.train.user_ids = users
    return splits


def user_codes(users: Sequence[Any], source: str) -> torch.Tensor:
    """int64 `[N]`: each row's user as a number, users numbered in order of first appearance
    (the values themselves, names or numbers, are kept out of the tensors). ConfigError naming
    dataset.user_column for a row without a user (an empty cell)."""
    missing = [i for i, u in enumerate(users) if _missing(u)]
    if missing:
        raise ConfigError(f"dataset.user_column: {source} has {len(missing)} row(s) without a user "
                          f"(the first is data row {missing[0] + 1}); user-level privacy needs "
                          f"the user of every training row. Fill the column in the file.")
    codes: dict[Any, int] = {}
    return torch.tensor([codes.setdefault(u, len(codes)) for u in users], dtype=torch.int64)


# ----------------------------------------------------------------------------- hub datasets
@dataclass(frozen=True)
class HubText:
    """A text dataset of the Hugging Face hub: where it is, which of its splits are our train and
    test splits, its columns (`prompt` and `label` None when it has none), its real sizes."""

    name: str
    hub_id: str
    config: str | None
    revision: str | None
    splits: dict[str, str]              # ours -> theirs
    text: str
    prompt: str | None
    label: str | None
    sizes: dict[str, int]               # ours -> rows (the synthetic look-alike's too)

    @property
    def task(self) -> str:
        return CLASSIFICATION if self.label is not None else CAUSAL_LM


SST2 = HubText("glue_sst2", "nyu-mll/glue", "sst2", None, {"train": "train", "test": "validation"},
               "sentence", None, "label", {"train": 67_349, "test": 872})
E2E = HubText("e2e_nlg", "tuetschek/e2e_nlg", None, "refs/convert/parquet",
              {"train": "train", "test": "test"}, "human_reference", "meaning_representation",
              None, {"train": 42_061, "test": 4_693})


def _hub_dataset(spec: HubText, root: Path, download: bool) -> Any:
    """The `datasets.DatasetDict` saved in `root`; downloaded (and saved there) first only when
    `download`."""
    import datasets

    if (root / "dataset_dict.json").is_file():
        return datasets.load_from_disk(str(root))
    if not download:
        require_files(spec.name, [root / "dataset_dict.json"], root)
    try:
        loaded = datasets.load_dataset(spec.hub_id, spec.config, revision=spec.revision)
        loaded.save_to_disk(str(root))
    except Exception as error:  # network, hub or disk: one message, the cause attached
        raise download_failed(spec.name, root, error) from error
    return loaded


def _hub_parts(spec: HubText, loaded: Any, max_samples: int | None, key: bytes
               ) -> tuple[dict[str, tuple[list[Row], list[Any] | None]], tuple[str, ...]]:
    """(rows, labels) of our train/test splits from the hub dataset's named splits, and the
    `private_preprocessing` sentence of the training split's cap (`_cap`)."""
    parts, steps = {}, ()
    for ours, theirs in spec.splits.items():
        table = loaded[theirs]
        source = f"the {theirs} split of dataset={spec.name}"
        columns = {c: table[c] for c in table.column_names}
        texts = column(columns, spec.text, "text column", source)
        prompts = column(columns, spec.prompt, "prompt column", source) if spec.prompt else None
        labels = column(columns, spec.label, "label column", source) if spec.label else None
        keep = _cap((texts, prompts, labels), max_samples, key,
                    TRAIN_CAP if ours == "train" else TEST_CAP)
        rows = [(None if prompts is None else str(prompts[i]), str(texts[i])) for i in keep]
        parts[ours] = (rows, _take(labels, keep))
        if ours == "train":
            steps = cap_steps(max_samples, len(keep), len(texts))
    return parts, steps


def load_hub_text(spec: HubText, *, root: str, download: bool, synthetic: bool,
                  tokenizer: str | None, pad_token: str | None, max_len: int,
                  max_samples: int | None, seed: int,
                  split_key: bytes | None = None) -> DatasetSplits:
    """The splits of `spec` (its synthetic look-alike with `synthetic`), tokenised; 2 classes
    for a classification dataset. `max_samples` keeps the rows of smallest keyed hash under
    `split_key` (None: a fresh key)."""
    max_len = _check_max_len(max_len)
    tok = _tokenizer(tokenizer, pad_token, download)
    classes = 2 if spec.task == CLASSIFICATION else None
    if synthetic:
        parts = _synthetic_parts(spec.sizes, spec.task, 2, spec.prompt is not None, seed,
                                 max_samples)
        return _splits(spec.name, tok, spec.task, max_len, classes, parts, {"synthetic": True})
    loaded = _hub_dataset(spec, Path(root).expanduser(), download)
    split_key = split_key_or_new(split_key)
    parts, steps = _hub_parts(spec, loaded, max_samples, split_key)
    return replace(_splits(spec.name, tok, spec.task, max_len, classes, parts, {}),
                   private_preprocessing=steps, split_key=split_key)


def load_glue_sst2(*, root: str = "~/.cache/dptrain/glue_sst2", download: bool = False,
                   synthetic: bool = False, tokenizer: str | None = None,
                   pad_token: str | None = None, max_len: int = 256,
                   max_samples: int | None = None, seed: int = 0,
                   split_key: bytes | None = None) -> DatasetSplits:
    """GLUE SST-2 (hub `nyu-mll/glue`, config `sst2`): 67,349 training sentences, 2 classes.

    The test split is GLUE's validation split (872 sentences): GLUE hides the test labels, and
    the papers this is compared with report validation accuracy.
    """
    return load_hub_text(SST2, **locals())


def load_e2e_nlg(*, root: str = "~/.cache/dptrain/e2e_nlg", download: bool = False,
                 synthetic: bool = False, tokenizer: str | None = None,
                 pad_token: str | None = None, max_len: int = 100,
                 max_samples: int | None = None, seed: int = 0,
                 split_key: bytes | None = None) -> DatasetSplits:
    """E2E NLG (hub `tuetschek/e2e_nlg`, its Parquet branch): restaurant meaning
    representations (the prompt, no loss) -> one reference text each (the loss); 42,061 training
    pairs, 4,693 test pairs. A causal LM dataset (`model.task=causal_lm`)."""
    return load_hub_text(E2E, **locals())
