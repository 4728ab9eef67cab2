"""Datasets for the `dptrain` command: digits (embedded), mnist, cifar10, imdb, text files, GLUE
SST-2 and E2E (tokenised for a pretrained model: dptrain.data.datasets.text), or random look-alikes.

`load_dataset(name, **options)` returns a `DatasetSplits` (train/test `ArrayDataset`s and the
number of classes). Options shared by every dataset: `root` (folder of the files; `~` expanded),
`download`, `synthetic` (seeded random data of the same shapes, sizes and number of classes),
`max_samples` (each split capped to that many examples), `seed` (synthetic data) and
`validation_size` (training examples held out as a validation split, after the cap: a count or a
fraction; see `DatasetSplits.with_validation`); IMDb also takes `vocab_size`, `max_len` and
`vocabulary`. No Hydra here: options are plain values. The rows the cap keeps and the split holds
out are chosen by a keyed hash of each row's contents with `split_key`, a secret key that is no
option of the config (`dptrain.data.datasets.selection`): `load_dataset` draws one from OS
entropy unless given the one a checkpoint saved, and returns it as `DatasetSplits.split_key`.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from dptrain.checks import POSITIVE_INT
from dptrain.data.datasets.base import ArrayDataset, DatasetSplits
from dptrain.data.datasets.cifar10 import load_cifar10
from dptrain.data.datasets.digits import load_digits
from dptrain.data.datasets.imdb import load_imdb
from dptrain.data.datasets.mnist import load_mnist
from dptrain.data.datasets.selection import split_key_or_new
from dptrain.data.datasets.text import load_e2e_nlg, load_glue_sst2, load_text
from dptrain.errors import ConfigError

DATASETS: dict[str, Callable[..., DatasetSplits]] = {
    "digits": load_digits,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "imdb": load_imdb,
    "text": load_text,
    "glue_sst2": load_glue_sst2,
    "e2e_nlg": load_e2e_nlg,
}

# Options every dataset accepts (a loader may ignore some, e.g. digits has no root).
COMMON_OPTIONS = ("root", "download", "synthetic", "max_samples", "seed", "validation_size")
# Loader keywords that are no config option: the secret split key (dptrain.data.datasets.selection)
# must never be written in a config, which the ledger publishes.
PRIVATE_OPTIONS = ("split_key",)

__all__ = ["ArrayDataset", "DATASETS", "DatasetSplits", "load_dataset"]


def load_dataset(
    name: str,
    *,
    max_samples: int | None = None,
    seed: int = 0,
    validation_size: int | float = 0,
    split_key: bytes | None = None,
    **options: Any,
) -> DatasetSplits:
    """The train/test (and validation, when `validation_size` is not 0) splits of dataset `name`
    (one of DATASETS) built with `options`.

    `split_key` (32 bytes) chooses the rows `max_samples` keeps and `validation_size` holds out;
    None draws a fresh one from OS entropy. A resumed run passes the key its checkpoint saved
    (`dptrain.train.checkpoint.saved_split_key`) to train on the same rows. The result's
    `split_key` is the key used: keep it as privately as the data (a checkpoint does)."""
    if name not in DATASETS:
        close = difflib.get_close_matches(str(name), DATASETS, n=1)
        hint = f" Did you mean dataset={close[0]}?" if close else ""
        raise ConfigError(
            f"dataset.name={name!r} is not a known dataset; choose one of {sorted(DATASETS)}.{hint}"
        )
    POSITIVE_INT.or_none().check(max_samples, "dataset.max_samples")
    _check_options(name, options)
    key = split_key_or_new(split_key)
    splits = DATASETS[name](max_samples=max_samples, seed=seed, split_key=key, **options)
    return splits.with_validation(validation_size, key)


def dataset_options(name: str) -> list[str]:
    """The options dataset `name` accepts: COMMON_OPTIONS plus its loader's own keywords."""
    parameters = inspect.signature(DATASETS[name]).parameters.values()
    own = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return sorted((set(COMMON_OPTIONS) | set(own)) - set(PRIVATE_OPTIONS))


def _check_options(name: str, options: dict[str, Any]) -> None:
    """ConfigError for an option the loader would silently ignore (e.g. +dataset.vocab_sise)."""
    known = dataset_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" Did you mean dataset.{close[0]}?" if close else ""
        raise ConfigError(
            f"dataset.{unknown[0]} is not an option of dataset={name}: it would be ignored.{hint} "
            f"Remove it; dataset={name} takes {', '.join(known)}."
        )
