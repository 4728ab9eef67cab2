"""In-memory datasets shared by every loader: the split container, the tensor dataset, subsets.

All loaders return a `DatasetSplits` whose `train`/`test` are `ArrayDataset`s: features kept in
their compact stored dtype (uint8 images, int64 token ids) and turned into model inputs one batch
at a time by a picklable `transform`, so MNIST/CIFAR-10 stay at one byte per pixel in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset

from dptrain.data.datasets.selection import (TEST_CAP, TRAIN_CAP, VALIDATION, array_records,
                                             below, cap_steps, describe_validation,
                                             keep_smallest, row_draws, split_key_or_new)
from dptrain.errors import ConfigError

BatchTransform = Callable[[torch.Tensor], torch.Tensor]


class Normalize:
    """Batch transform: stored integers [B, C, *spatial] -> float32 ((x / scale) - mean) / std.

    `mean` and `std` hold one value per channel (dim 1) or a single value for every feature.
    """

    def __init__(self, scale: float, mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,)):
        self.scale = float(scale)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.to(torch.float32) / self.scale
        if len(self.mean) == 1:
            return (out - self.mean[0]) / self.std[0]
        shape = (1, len(self.mean)) + (1,) * (out.dim() - 2)
        mean = torch.tensor(self.mean).view(shape)
        std = torch.tensor(self.std).view(shape)
        return (out - mean) / std


class ArrayDataset(Dataset):
    """Examples held as tensors: `features` [N, *sample_shape], `labels` int64 [N].

    `dataset[i]` is `(transform(features[i:i+1])[0], labels[i])`; `__getitems__` (used by the
    DataLoader for a whole batch of indices) transforms the batch in one vectorized call.
    `user_ids`, when set, is int64 [N]: the user of each example (user-level privacy), carried
    along by `subset`.
    """

    user_ids: torch.Tensor | None = None

    def __init__(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        transform: BatchTransform | None = None,
    ) -> None:
        if len(features) != len(labels):
            raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
        self.features = features
        self.labels = labels.to(torch.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def _inputs(self, rows: torch.Tensor) -> torch.Tensor:
        return self.transform(rows) if self.transform is not None else rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._inputs(self.features[index : index + 1])[0], self.labels[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = torch.as_tensor(list(indices), dtype=torch.int64)
        inputs = self._inputs(self.features[idx])
        return list(zip(inputs.unbind(0), self.labels[idx].unbind(0)))

    def subset(self, indices: torch.Tensor) -> "ArrayDataset":
        """The examples at `indices` (int64 [n]) as a new dataset of the same class (a text
        dataset's items stay mappings) sharing the transform."""
        part = type(self)(self.features[indices], self.labels[indices], self.transform)
        if self.user_ids is not None:
            part.user_ids = self.user_ids[indices]
        return part

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one model input (after the transform), e.g. (1, 28, 28)."""
        return tuple(self[0][0].shape) if len(self) else tuple(self.features.shape[1:])


@dataclass
class DatasetSplits:
    """A dataset's train and test splits plus what the model config needs to know.

    `info` carries loader-specific facts (e.g. IMDb's `vocab_size` and `max_len`). `validation`,
    when not None, holds examples taken out of the training split (`with_validation`): they are
    never trained on, and `len(train)` (N, the training examples the accountant counts) excludes
    them. `private_preprocessing` describes each preprocessing step that read the training
    examples' contents (e.g. a vocabulary counted over them), one sentence each naming its config
    key, and what epsilon covers of it (a vocabulary counted over them: nothing; a validation
    split drawn row by row: a row of the file). Empty when no step read the training examples
    (fixed normalisation constants, a hashing vocabulary, no subset, no validation split).
    """

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    info: dict[str, Any] = field(default_factory=dict)
    validation: ArrayDataset | None = None
    private_preprocessing: tuple[str, ...] = ()
    # The secret key that chose the rows of `capped` and `with_validation` (32 bytes, OS
    # entropy; dptrain.data.datasets.selection): private resume state, kept out of the repr.
    split_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for split in ("train", "validation", "test"):
            part = getattr(self, split)
            if part is not None:
                refuse_non_finite(part.features, f"dataset '{self.name}' ({split} split)")

    def capped(self, max_samples: int | None, key: bytes | None = None) -> "DatasetSplits":
        """Train and test cut to at most `max_samples` examples each: the rows with the smallest
        keyed hash of their contents (`dptrain.data.datasets.selection`), `key` the secret
        split key (None: a fresh one from OS entropy), recorded in `split_key`. Apply before
        `with_validation` (the validation examples are not capped). Cutting the training split
        adds its sentence to `private_preprocessing`: the unit epsilon then holds for."""
        key = split_key_or_new(key if key is not None else self.split_key)
        if max_samples is None:
            return replace(self, split_key=key)
        train = keyed_subset(self.train, max_samples, key, TRAIN_CAP)
        return replace(
            self,
            train=train,
            test=keyed_subset(self.test, max_samples, key, TEST_CAP),
            info=dict(self.info),
            private_preprocessing=(*self.private_preprocessing,
                                   *cap_steps(max_samples, len(train), len(self.train))),
            split_key=key,
        )

    def with_validation(self, validation_size: int | float,
                        key: bytes | None = None) -> "DatasetSplits":
        """Training examples moved to `validation`, each row's place decided by a keyed hash of
        its contents (`dptrain.data.datasets.selection`; `key` the secret split key, None: the
        one in `split_key`, else a fresh one): a float fraction holds out each row whose hash
        falls below it, independently of the others; an int count the rows with the smallest
        hashes. Both parts keep the training split's order; `private_preprocessing` gets the
        split's sentence. 0 returns the splits unchanged.

        Raises ConfigError (naming dataset.validation_size) for a size that leaves no example on
        either side, and for a count when the training split has user ids (user level).
        """
        key = split_key_or_new(key if key is not None else self.split_key)
        count = validation_count(validation_size, len(self.train))
        if count == 0:
            return replace(self, split_key=key)
        held_out = held_out_rows(self.train, validation_size, count, key)
        if not 0 < int(held_out.sum()) < len(self.train):  # a fraction's draw, on few rows
            raise _size_refusal(validation_size, len(self.train),
                                f" (each row held out with probability {validation_size}, "
                                f"{int(held_out.sum())} were)")
        sentence = describe_validation(validation_size, int(held_out.sum()), len(self.train))
        return replace(
            self,
            train=self.train.subset(torch.nonzero(~held_out).flatten()),
            info=dict(self.info),
            validation=self.train.subset(torch.nonzero(held_out).flatten()),
            private_preprocessing=(*self.private_preprocessing, sentence),
            split_key=key,
        )


def held_out_rows(train: ArrayDataset, validation_size: int | float, count: int,
                  key: bytes) -> torch.Tensor:
    """bool `[N]`: the training rows `dataset.validation_size` holds out (see
    `DatasetSplits.with_validation`); `count` is its `validation_count`."""
    draws = row_draws(array_records(train.features, train.labels), key, VALIDATION)
    if isinstance(validation_size, float):
        return below(draws, validation_size)
    if train.user_ids is not None:
        raise ConfigError(
            f"dataset.validation_size={validation_size} is a count, and the training rows have "
            f"users (dataset.user_column, privacy.unit=user): a count holds out the rows with "
            f"the smallest keyed hashes together, so removing one user's rows would move rows "
            f"of other users out of training, and epsilon would not hold for a user of the "
            f"file. Give a fraction instead (e.g. dataset.validation_size="
            f"{max(count / len(train), 0.01):.2g}): each row is then held out on its own.")
    held_out = torch.zeros(len(train), dtype=torch.bool)
    held_out[keep_smallest(draws, count)] = True
    return held_out


def validation_count(validation_size: Any, num_train: int) -> int:
    """The number of examples `dataset.validation_size` holds out of `num_train` training ones.

    An int is a count in [0, num_train); a float in (0, 1) a fraction, rounded to the nearest
    count (the expected size of its split, drawn row by row), which must be at least 1 and leave
    at least one training example. 0 (or 0.0) is none.
    """
    value = validation_size
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        count = -1  # refused below
    elif isinstance(value, int) or value == 0:
        count = int(value)
    elif 0 < value < 1:
        count = round(value * num_train) or -1  # too small a fraction for one example
    else:
        count = -1
    if count != 0 and not 0 < count < num_train:
        raise _size_refusal(validation_size, num_train)
    return count


def _size_refusal(validation_size: Any, num_train: int, drawn: str = "") -> ConfigError:
    """The refusal of a `dataset.validation_size` that leaves no example on one side (`drawn`:
    what a fraction's row-by-row draw held out, when that is the reason)."""
    return ConfigError(
        f"dataset.validation_size={validation_size!r} cannot be held out of the {num_train} "
        f"training examples{drawn}: set it to a count in [0, {num_train}) or a fraction in "
        f"(0, 1) that keeps at least one example on each side (e.g. "
        f"dataset.validation_size=0.1; 0 means no validation split)."
    )


def keyed_subset(dataset: ArrayDataset, max_samples: int, key: bytes,
                 purpose: str) -> ArrayDataset:
    """At most `max_samples` examples of `dataset`, in its order: those with the smallest keyed
    hash of their contents (`dptrain.data.datasets.selection.row_draws` for `purpose`)."""
    if max_samples >= len(dataset):
        return dataset
    draws = row_draws(array_records(dataset.features, dataset.labels), key, purpose)
    return dataset.subset(keep_smallest(draws, max_samples))


def non_finite_row(values: torch.Tensor | Sequence[Any]) -> int | None:
    """The first row (0-based) of `values` that holds a NaN or infinite number, or None.

    `values`: a tensor `[N, *shape]` (a row is non-finite when any of its entries is; integer
    tensors never are), or a column of N cells (a float cell that is NaN or inf: pandas reads an
    empty cell, NaN or NA as NaN).
    """
    if isinstance(values, torch.Tensor):
        if not values.is_floating_point() or len(values) == 0:
            return None
        bad = ~torch.isfinite(values.reshape(len(values), -1)).all(dim=1)
        return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None
    return next((i for i, v in enumerate(values)
                 if isinstance(v, float) and not math.isfinite(v)), None)


def refuse_non_finite(values: torch.Tensor | Sequence[Any], source: str,
                      row_name: Callable[[int], str] = lambda i: f"example {i} (0-based)") -> None:
    """ConfigError naming `source` and the first row of `values` (`non_finite_row`) that holds a
    NaN or infinite input, with the fix; nothing when every row is finite.

    THE check of non-finite inputs, made when a dataset is built (`DatasetSplits` for feature
    tensors, the text loader for a file's cells): never during training, where the step that
    meets such an example would reveal that it was sampled. `row_name(i)` words row i for the
    user (a file's loader numbers the rows as the file does).
    """
    row = non_finite_row(values)
    if row is None:
        return
    raise ConfigError(
        f"{source}: {row_name(row)} holds a NaN or infinite value (an empty cell, or NaN or inf "
        f"in the data) where an input is expected. An example whose input is not finite has a "
        f"gradient that is not finite: every step would leave it out (its clip factor is 0), so "
        f"it would never be trained on, and dptrain refuses it before training rather than meet "
        f"it during a run, whose failing step would reveal when that example was sampled. Fix or "
        f"remove that row (with pandas: frame.dropna(subset=[column])), then run again."
    )


def require_files(name: str, paths: Sequence[Path], root: Path) -> None:
    """Raise ConfigError naming the first missing file and how to get the dataset."""
    for path in paths:
        if not path.exists():
            raise ConfigError(
                f"dataset '{name}' is not on disk: {path} does not exist (dataset.root={root}). "
                f"Add dataset.download=true to download it into dataset.root, point dataset.root "
                f"at a folder that holds it, or use dataset.synthetic=true for random data of the "
                f"same shapes."
            )


def download_failed(name: str, root: Path, error: Exception) -> ConfigError:
    """The error for a download that did not work (offline machine, blocked URL...)."""
    return ConfigError(
        f"dataset '{name}': downloading into dataset.root={root} failed ({error}). Check the "
        f"network, or copy the files there by hand and run with dataset.download=false, or use "
        f"dataset.synthetic=true."
    )
