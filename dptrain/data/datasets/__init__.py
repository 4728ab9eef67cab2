"""Datasets for the `dptrain` command: digits (embedded), mnist, cifar10, imdb, or random look-alikes.

`load_dataset(name, **options)` returns a `DatasetSplits` (train/test `ArrayDataset`s and the
number of classes). Options shared by every dataset: `root` (folder of the files; `~` expanded),
`download`, `synthetic` (seeded random data of the same shapes, sizes and number of classes),
`max_samples` (each split capped to that many examples, a seeded random subset) and `seed`;
IMDb also takes `vocab_size` and `max_len`. No Hydra here: options are plain values.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from dptrain.data.datasets.base import ArrayDataset, DatasetSplits
from dptrain.data.datasets.cifar10 import load_cifar10
from dptrain.data.datasets.digits import load_digits
from dptrain.data.datasets.imdb import load_imdb
from dptrain.data.datasets.mnist import load_mnist
from dptrain.errors import ConfigError

DATASETS: dict[str, Callable[..., DatasetSplits]] = {
    "digits": load_digits,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "imdb": load_imdb,
}

__all__ = ["ArrayDataset", "DATASETS", "DatasetSplits", "load_dataset"]


def _check_max_samples(max_samples: Any) -> None:
    if max_samples is not None and (
        isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 1
    ):
        raise ConfigError(
            f"dataset.max_samples={max_samples!r} must be a positive integer or null "
            f"(null keeps every example), e.g. dataset.max_samples=512."
        )


def load_dataset(
    name: str, *, max_samples: int | None = None, seed: int = 0, **options: Any
) -> DatasetSplits:
    """The train/test splits of dataset `name` (one of DATASETS) built with `options`."""
    if name not in DATASETS:
        close = difflib.get_close_matches(str(name), DATASETS, n=1)
        hint = f" Did you mean dataset={close[0]}?" if close else ""
        raise ConfigError(
            f"dataset.name={name!r} is not a known dataset; choose one of {sorted(DATASETS)}.{hint}"
        )
    _check_max_samples(max_samples)
    return DATASETS[name](max_samples=max_samples, seed=seed, **options)
