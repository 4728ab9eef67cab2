"""IMDb movie-review sentiment (Maas et al. 2011) from the aclImdb folder or archive.

Reads `<root>/aclImdb/{train,test}/{pos,neg}/*.txt` (the layout of the official archive), or, when
that folder is absent, the archive `<root>/aclImdb_v1.tar.gz` directly (no extraction);
`download=True` fetches the archive first. Labels: neg = 0, pos = 1. Files are read in sorted
order, so the result does not depend on the file system.

Text -> model input, as in the Fast-DPSGD / Opacus paper benchmarks (Keras `imdb.load_data`):
- tokenizer: lowercase, replace `<br />` by a space, split on runs of non-word characters (`\\W+`);
- vocabulary: the `vocab_size` (10,000) most frequent words of the TRAINING split only (ties broken
  alphabetically), numbered from 4; reserved indices pad = 0, start = 1, unknown = 2, unused = 3,
  so token ids lie in [0, vocab_size + 4);
- sequence: [start, w_1, w_2, ...] fitted to exactly `max_len` (256) ids the way the benchmarks'
  Keras `pad_sequences` (defaults padding="pre", truncating="pre") does: a longer review keeps
  its LAST `max_len` ids, a shorter one is padded with pad = 0 in FRONT. Inputs are int64
  [max_len].
"""

from __future__ import annotations

import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

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

Review = tuple[str, int]  # (text, label)


def tokenize(text: str) -> list[str]:
    """Lowercased words of `text`, `<br />` removed, split on non-word characters."""
    return [w for w in _SPLIT_WORDS.split(text.lower().replace("<br />", " ")) if w]


def build_vocabulary(token_lists: Iterable[list[str]], vocab_size: int) -> dict[str, int]:
    """word -> id (4, 5, ...) for the `vocab_size` most frequent words (ties: alphabetical)."""
    counts = Counter(word for tokens in token_lists for word in tokens)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:vocab_size]
    return {word: NUM_RESERVED + rank for rank, (word, _) in enumerate(ranked)}


def encode(tokens: list[str], vocabulary: dict[str, int], max_len: int) -> torch.Tensor:
    """int64 [max_len]: start token, then word ids (unknown = 2); only the last max_len ids are
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
    reviews: list[Review], tokens: list[list[str]], vocabulary: dict[str, int], max_len: int
) -> ArrayDataset:
    """Token ids int64 [n, max_len] and labels int64 [n] of one split."""
    rows = [encode(t, vocabulary, max_len) for t in tokens]
    features = torch.stack(rows) if rows else torch.zeros(0, max_len, dtype=torch.int64)
    labels = torch.tensor([label for _, label in reviews], dtype=torch.int64)
    return ArrayDataset(features, labels)


def _check_sizes(vocab_size: int, max_len: int) -> None:
    for key, value in (("vocab_size", vocab_size), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"dataset.{key}={value!r} must be a positive integer (IMDb defaults: "
                f"dataset.vocab_size=10000 dataset.max_len=256)."
            )


def load_imdb(
    root: str | Path,
    download: bool = False,
    synthetic: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    vocab_size: int = 10_000,
    max_len: int = 256,
    **_: object,
) -> DatasetSplits:
    """IMDb train/test splits of encoded reviews (see the module docstring for the encoding)."""
    _check_sizes(vocab_size, max_len)
    info = {"vocab_size": vocab_size, "max_len": max_len}
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
    vocabulary = build_vocabulary(tokens["train"], vocab_size)
    splits = DatasetSplits(
        "imdb",
        _encode_split(reviews["train"], tokens["train"], vocabulary, max_len),
        _encode_split(reviews["test"], tokens["test"], vocabulary, max_len),
        2,
        {**info, "vocabulary_words": len(vocabulary)},
    )
    return splits.capped(max_samples, seed)
