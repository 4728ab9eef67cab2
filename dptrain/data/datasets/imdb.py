"""IMDb movie-review sentiment (Maas et al. 2011) from the aclImdb folder or archive.

Reads `<root>/aclImdb/{train,test}/{pos,neg}/*.txt` (the layout of the official archive), or, when
that folder is absent, the archive `<root>/aclImdb_v1.tar.gz` directly (no extraction);
`download=True` fetches the archive first. Labels: neg = 0, pos = 1. Files are read in sorted
order, so the result does not depend on the file system.

Text -> model input, as in the Fast-DPSGD / Opacus paper benchmarks (Keras `imdb.load_data`):
- tokenizer: lowercase, replace `<br />` by a space, split on runs of non-word characters (`\\W+`);
- vocabulary (`vocabulary`), word -> id in [4, vocab_size + 4); reserved ids pad = 0, start = 1,
  unknown = 2, unused = 3, so token ids lie in [0, vocab_size + 4):
  - "hashing" (default): id = 4 + CRC-32 of the word's UTF-8 bytes mod `vocab_size`. Fixed before
    any review is read, so a review's ids depend on that review alone (words may share an id);
  - "train_counts": the `vocab_size` (10,000) most frequent words of the TRAINING split (ties
    broken alphabetically), numbered from 4, other words unknown = 2 (the paper benchmarks'
    vocabulary). It is computed from the private training reviews, so one review can change
    every review's encoding: epsilon does not cover it, and the splits' `private_preprocessing`
    says so;
- sequence: [start, w_1, w_2, ...] fitted to exactly `max_len` (256) ids the way the benchmarks'
  Keras `pad_sequences` (defaults padding="pre", truncating="pre") does: a longer review keeps
  its LAST `max_len` ids, a shorter one is padded with pad = 0 in FRONT. Inputs are int64
  [max_len].
"""

from __future__ import annotations

import re
import tarfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch

from dptrain.data.datasets.base import ArrayDataset, DatasetSplits, download_failed, require_files
from dptrain.data.datasets.synthetic import SyntheticSpec, synthetic_splits
from dptrain.errors import ConfigError

PAD, START, UNKNOWN, UNUSED = 0, 1, 2, 3
NUM_RESERVED = 4
LABELS = {"neg": 0, "pos": 1}
ARCHIVE = "aclImdb_v1.tar.gz"
URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
_SPLIT_WORDS = re.compile(r"\W+")
_PATH = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg)/[^/]+\.txt$")
VOCABULARIES = ("hashing", "train_counts")  # dataset.vocabulary; the first is the default

Review = tuple[str, int]  # (text, label)


class Vocabulary(Protocol):
    """word -> token id, `default` for a word it has no id for (a dict is one)."""

    def get(self, word: str, default: int, /) -> int: ...


class HashingVocabulary:
    """word -> NUM_RESERVED + CRC-32(word as UTF-8) mod `vocab_size`: an id for every word, the
    same on every machine and Python run (unlike the salted `hash`), chosen before any data."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = {}  # memo: a review set repeats few distinct words

    def get(self, word: str, default: int = UNKNOWN, /) -> int:
        """The id of `word` in [NUM_RESERVED, NUM_RESERVED + vocab_size); never `default`."""
        found = self._ids.get(word)
        if found is None:
            found = NUM_RESERVED + zlib.crc32(word.encode("utf-8")) % self.vocab_size
            self._ids[word] = found
        return found


def tokenize(text: str) -> list[str]:
    """Lowercased words of `text`, `<br />` removed, split on non-word characters."""
    return [w for w in _SPLIT_WORDS.split(text.lower().replace("<br />", " ")) if w]


def build_vocabulary(token_lists: Iterable[list[str]], vocab_size: int) -> dict[str, int]:
    """word -> id (4, 5, ...) for the `vocab_size` most frequent words (ties: alphabetical)."""
    counts = Counter(word for tokens in token_lists for word in tokens)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:vocab_size]
    return {word: NUM_RESERVED + rank for rank, (word, _) in enumerate(ranked)}


def encode(tokens: list[str], vocabulary: Vocabulary, max_len: int) -> torch.Tensor:
    """int64 [max_len]: start token, then word ids (unknown = 2 for a word `vocabulary` has no id
    for; a hashing vocabulary has one for every word); only the last max_len ids are
    kept, and a shorter sequence is padded with 0 in front (Keras pad_sequences' defaults)."""
    ids = [START] + [vocabulary.get(word, UNKNOWN) for word in tokens]
    ids = [PAD] * max(0, max_len - len(ids)) + ids[-max_len:]
    return torch.tensor(ids, dtype=torch.int64)


def _folder_reviews(folder: Path, split: str) -> Iterator[Review]:
    for label_name, label in LABELS.items():
        for path in sorted((folder / split / label_name).glob("*.txt")):
            yield path.read_text(encoding="utf-8", errors="replace"), label


def _archive_reviews(archive: Path) -> dict[str, list[tuple[str, Review]]]:
    """split -> [(member name, (text, label))] for every review in the tar archive."""
    found: dict[str, list[tuple[str, Review]]] = {"train": [], "test": []}
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            match = _PATH.search(member.name)
            if member.isfile() and match:
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                found[match.group(1)].append((member.name, (text, LABELS[match.group(2)])))
    return found


def read_reviews(root: Path) -> dict[str, list[Review]]:
    """split -> reviews, from `root/aclImdb/` if present, else from `root/aclImdb_v1.tar.gz`."""
    folder, archive = root / "aclImdb", root / ARCHIVE
    if folder.is_dir():
        require_files("imdb", [folder / "train" / "pos", folder / "test" / "pos"], root)
        return {split: list(_folder_reviews(folder, split)) for split in ("train", "test")}
    if not archive.exists():
        raise ConfigError(
            f"dataset 'imdb' is not on disk: neither the folder {folder} nor the archive {archive} "
            f"exists (dataset.root={root}). Add dataset.download=true to download the archive into "
            f"dataset.root, point dataset.root at a folder that holds aclImdb/, or use "
            f"dataset.synthetic=true for random data of the same shapes."
        )
    by_split = _archive_reviews(archive)
    return {
        split: [review for _, review in sorted(entries, key=lambda e: (e[1][1], e[0]))]
        for split, entries in by_split.items()
    }


def _download(root: Path) -> None:
    from torchvision.datasets.utils import download_url

    if (root / "aclImdb").is_dir() or (root / ARCHIVE).exists():
        return
    try:
        download_url(URL, str(root), ARCHIVE)
    except Exception as error:  # network errors come in many types
        raise download_failed("imdb", root, error) from error


def _encode_split(
    reviews: list[Review], tokens: list[list[str]], vocabulary: Vocabulary, max_len: int
) -> ArrayDataset:
    """Token ids int64 [n, max_len] and labels int64 [n] of one split."""
    rows = [encode(t, vocabulary, max_len) for t in tokens]
    features = torch.stack(rows) if rows else torch.zeros(0, max_len, dtype=torch.int64)
    labels = torch.tensor([label for _, label in reviews], dtype=torch.int64)
    return ArrayDataset(features, labels)


def _check_options(vocab_size: int, max_len: int, vocabulary: str) -> None:
    for key, value in (("vocab_size", vocab_size), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"dataset.{key}={value!r} must be a positive integer (IMDb defaults: "
                f"dataset.vocab_size=10000 dataset.max_len=256)."
            )
    if vocabulary not in VOCABULARIES:
        raise ConfigError(
            f"dataset.vocabulary={vocabulary!r} is not an IMDb vocabulary: use "
            f"dataset.vocabulary=hashing (the default: word ids fixed before any review is read) "
            f"or dataset.vocabulary=train_counts (the vocab_size most frequent training words, "
            f"computed from the private training reviews and not covered by epsilon)."
        )


def _train_counts_note(vocab_size: int) -> str:
    """The `private_preprocessing` entry of dataset.vocabulary=train_counts."""
    return (
        f"dataset.vocabulary=train_counts: the word ids are the ranks of the {vocab_size} most "
        f"frequent words counted over every review of the training split (including those "
        f"dataset.max_samples leaves out or dataset.validation_size holds out), so one review "
        f"can change the encoding of every review; epsilon does not cover this"
    )


def make_vocabulary(
    vocabulary: str, train_tokens: list[list[str]], vocab_size: int
) -> tuple[Vocabulary, tuple[str, ...]]:
    """The `vocabulary` kind (one of VOCABULARIES) built for `vocab_size` words, and the
    preprocessing steps that read the private training reviews to build it (none for hashing)."""
    if vocabulary == "hashing":
        return HashingVocabulary(vocab_size), ()
    return build_vocabulary(train_tokens, vocab_size), (_train_counts_note(vocab_size),)


def load_imdb(
    root: str | Path,
    download: bool = False,
    synthetic: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    split_key: bytes | None = None,
    vocab_size: int = 10_000,
    max_len: int = 256,
    vocabulary: str = "hashing",
    **_: object,
) -> DatasetSplits:
    """IMDb train/test splits of encoded reviews (see the module docstring for the encoding).

    The splits' `private_preprocessing` names what read the training reviews before training
    (empty unless `vocabulary="train_counts"`; synthetic data has no vocabulary).
    """
    _check_options(vocab_size, max_len, vocabulary)
    info = {"vocab_size": vocab_size, "max_len": max_len, "vocabulary": vocabulary}
    if synthetic:
        spec = SyntheticSpec(
            25_000,
            25_000,
            (max_len,),
            2,
            vocab_size + NUM_RESERVED,
            low=NUM_RESERVED,
            dtype=torch.int64,
            info=info,
        )
        return synthetic_splits("imdb", spec, seed, max_samples)
    root = Path(root).expanduser()
    if download:
        _download(root)
    reviews = read_reviews(root)
    tokens = {split: [tokenize(text) for text, _ in reviews[split]] for split in reviews}
    words, private_preprocessing = make_vocabulary(vocabulary, tokens["train"], vocab_size)
    splits = DatasetSplits(
        "imdb",
        _encode_split(reviews["train"], tokens["train"], words, max_len),
        _encode_split(reviews["test"], tokens["test"], words, max_len),
        2,
        info,
        private_preprocessing=private_preprocessing,
    )
    return splits.capped(max_samples, split_key)
