"""Random data with the shapes, sizes and number of classes of a real dataset (seeded).

Used by `dataset.synthetic=true` for smoke tests and speed benchmarks: no file is read, and the
same seed gives the same examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dptrain.data.datasets.base import ArrayDataset, BatchTransform, DatasetSplits


@dataclass(frozen=True)
class SyntheticSpec:
    """What a real dataset looks like on disk, for drawing look-alike random data.

    Features are integers drawn uniformly from [low, high) with shape [N, *sample_shape] and
    dtype `dtype` (what the real loader stores), then fed through the real loader's `transform`.
    """

    train_size: int
    test_size: int
    sample_shape: tuple[int, ...]
    num_classes: int
    high: int
    low: int = 0
    dtype: torch.dtype = torch.uint8
    transform: BatchTransform | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _random_split(spec: SyntheticSpec, size: int, generator: torch.Generator) -> ArrayDataset:
    features = torch.randint(
        spec.low, spec.high, (size, *spec.sample_shape), generator=generator, dtype=torch.int64
    ).to(spec.dtype)
    labels = torch.randint(0, spec.num_classes, (size,), generator=generator)
    return ArrayDataset(features, labels, spec.transform)


def synthetic_splits(
    name: str, spec: SyntheticSpec, seed: int, max_samples: int | None = None
) -> DatasetSplits:
    """Random train/test splits like `spec`; each split has at most `max_samples` examples."""
    cap = max_samples if max_samples is not None else max(spec.train_size, spec.test_size)
    generator = torch.Generator().manual_seed(seed)
    train = _random_split(spec, min(spec.train_size, cap), generator)
    test = _random_split(spec, min(spec.test_size, cap), generator)
    return DatasetSplits(name, train, test, spec.num_classes, {**spec.info, "synthetic": True})
