"""Two small two-class sentiment sets of English sentences, written to CSV files by the tests
that fine-tune real pretrained weights (tests/cli/test_cli_hf_finetune_defaults.py).

`write_review_csvs`: 400 varied reviews (tests/data/reviews.csv, 200 positive and 200 negative,
written by hand for this project: products, films, books, restaurants, hotels, services; 1 to 20
words; negation such as "not bad at all", and mixed reviews labelled by their overall verdict).
This is the set the documented fine-tuning figures are measured on.

`write_sentiment_csvs` (templates, kept for the fast tests that need any real sentences): each
sentence puts a clearly positive or clearly negative adjective into a template about a
film, a meal, a hotel...; the label is 1 for positive, 0 for negative. The sentences are drawn
without replacement from every (template, subject, adjective) combination with a seeded shuffle,
so the train and test files share no sentence and each is balanced between the two classes.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

REVIEWS = Path(__file__).parent / "data" / "reviews.csv"

TEMPLATES = (
    "The {s} was {a}.",
    "I thought the {s} was {a}.",
    "Honestly, the {s} was {a}.",
    "Our {s} turned out {a}.",
    "Everyone agreed the {s} was {a}.",
    "What a {a} {s}.",
    "The {s} we had last week was {a}.",
    "My friends said the {s} was {a}.",
)
SUBJECTS = ("movie", "meal", "hotel", "concert", "book", "service", "trip", "game", "show",
            "restaurant", "class", "album")
POSITIVE = ("wonderful", "excellent", "delightful", "fantastic", "superb", "lovely", "brilliant",
            "amazing", "great", "enjoyable")
NEGATIVE = ("terrible", "awful", "dreadful", "horrible", "disappointing", "boring", "miserable",
            "poor", "unpleasant", "bad")


def sentences(label: int) -> list[str]:
    """Every sentence of one class (label 1: positive adjectives, 0: negative), in fixed order."""
    words = POSITIVE if label == 1 else NEGATIVE
    out = []
    for t in TEMPLATES:
        for s in SUBJECTS:
            for a in words:
                text = t.format(s=s, a=a)
                out.append(text[0].upper() + text[1:])
    return out


def write_sentiment_csvs(folder: Path, train_per_class: int = 150, test_per_class: int = 50,
                         seed: int = 0) -> tuple[Path, Path]:
    """Write train.csv and test.csv (columns text,label) into `folder`; their paths.

    `train_per_class` + `test_per_class` sentences of each class, no sentence in both files.
    """
    rng = random.Random(seed)
    rows: dict[str, list[tuple[str, int]]] = {"train": [], "test": []}
    for label in (0, 1):
        pool = sentences(label)
        rng.shuffle(pool)
        rows["train"] += [(t, label) for t in pool[:train_per_class]]
        rows["test"] += [(t, label) for t in pool[train_per_class:train_per_class + test_per_class]]
    return _write_splits(Path(folder), rows, rng)


def reviews() -> list[tuple[str, int]]:
    """The 400 hand-written reviews of tests/data/reviews.csv as (text, label), label 1 positive."""
    with REVIEWS.open(newline="") as f:
        return [(row["text"], int(row["label"])) for row in csv.DictReader(f)]


def write_review_csvs(folder: Path, test_per_class: int = 50, seed: int = 0
                      ) -> tuple[Path, Path]:
    """Split the reviews into `folder`/train.csv and test.csv (columns text,label); their paths.

    A seeded shuffle of each class puts `test_per_class` of its reviews in the test file and the
    rest (150 a class with the default) in the train file: both balanced, no review in both.
    """
    rng = random.Random(seed)
    split: dict[str, list[tuple[str, int]]] = {"train": [], "test": []}
    for label in (0, 1):
        pool = [row for row in reviews() if row[1] == label]
        rng.shuffle(pool)
        split["test"] += pool[:test_per_class]
        split["train"] += pool[test_per_class:]
    return _write_splits(Path(folder), split, rng)


def _write_splits(folder: Path, split: dict[str, list[tuple[str, int]]], rng: random.Random
                  ) -> tuple[Path, Path]:
    """Write each split's rows, shuffled, to folder/<split>.csv; the train and test paths."""
    paths = []
    for name, rows in split.items():
        rng.shuffle(rows)
        path = folder / f"{name}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(rows)
        paths.append(path)
    return paths[0], paths[1]
