"""The embedded digits dataset: 1,797 8x8 handwritten digits shipped inside the package.

The file `files/digits.csv.gz` holds one image per row (64 pixel values 0..16, then the label);
see files/DIGITS_LICENSE.txt. Inputs are float32 [64] (the flattened 8x8 image) scaled to [0, 1].

Split (fixed, stratified, no randomness): within each class, examples are taken in file order and
every fifth one (positions 4, 9, 14, ... of that class) goes to the test split, the rest to the
training split: 1,442 training and 355 test examples, each class 80/20.
"""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np
import torch

from dptrain.data.datasets.base import ArrayDataset, DatasetSplits, Normalize
from dptrain.data.datasets.synthetic import SyntheticSpec, synthetic_splits

NUM_CLASSES = 10
PIXEL_MAX = 16
TEST_EVERY = 5  # every fifth example of each class is a test example
TRANSFORM = Normalize(scale=PIXEL_MAX)


def read_digits_csv() -> tuple[torch.Tensor, torch.Tensor]:
    """The embedded file as (pixels uint8 [1797, 64] in 0..16, labels int64 [1797])."""
    data = resources.files("dptrain.data.datasets").joinpath("files/digits.csv.gz").read_bytes()
    table = np.loadtxt(
        gzip.decompress(data).decode("ascii").splitlines(), delimiter=",", dtype=np.int64
    )
    return torch.from_numpy(table[:, :-1].astype(np.uint8)), torch.from_numpy(table[:, -1])


def stratified_test_mask(labels: torch.Tensor, test_every: int = TEST_EVERY) -> torch.Tensor:
    """bool [N]: True for every `test_every`-th example of each class (in file order)."""
    mask = torch.zeros(len(labels), dtype=torch.bool)
    for cls in labels.unique():
        positions = (labels == cls).nonzero().flatten()
        mask[positions[test_every - 1 :: test_every]] = True
    return mask


def load_digits(
    synthetic: bool = False, max_samples: int | None = None, seed: int = 0,
    split_key: bytes | None = None, **_: object
) -> DatasetSplits:
    """Train/test splits of the embedded digits (or random look-alikes when `synthetic`)."""
    pixels, labels = read_digits_csv()
    test = stratified_test_mask(labels)
    if synthetic:
        spec = SyntheticSpec(
            int((~test).sum()),
            int(test.sum()),
            (64,),
            NUM_CLASSES,
            PIXEL_MAX + 1,
            transform=TRANSFORM,
        )
        return synthetic_splits("digits", spec, seed, max_samples)
    splits = DatasetSplits(
        "digits",
        ArrayDataset(pixels[~test], labels[~test], TRANSFORM),
        ArrayDataset(pixels[test], labels[test], TRANSFORM),
        NUM_CLASSES,
    )
    return splits.capped(max_samples, split_key)
