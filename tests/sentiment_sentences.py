"""A small two-class sentiment set of real English sentences, written to CSV files by the tests
that fine-tune real pretrained weights (tests/cli/test_hf_finetune_defaults.py).

Each sentence puts a clearly positive or clearly negative adjective into a template about a
film, a meal, a hotel...; the label is 1 for positive, 0 for negative. The sentences are drawn
without replacement from every (template, subject, adjective) combination with a seeded shuffle,
so the train and test files share no sentence and each is balanced between the two classes.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

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
    paths = []
    for split, split_rows in rows.items():
        rng.shuffle(split_rows)
        path = Path(folder) / f"{split}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(split_rows)
        paths.append(path)
    return paths[0], paths[1]
