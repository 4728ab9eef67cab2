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
        """The examples at `indices` (int64 [n]) as a new dataset sharing the transform."""
        part = ArrayDataset(self.features[indices], self.labels[indices], self.transform)
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
    key: epsilon does not cover these. Empty when the features of every example depend on that
    example alone (fixed normalisation constants, a hashing vocabulary).
    """

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    info: dict[str, Any] = field(default_factory=dict)
    validation: ArrayDataset | None = None
    private_preprocessing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for split in ("train", "validation", "test"):
            part = getattr(self, split)
            if part is not None:
                refuse_non_finite(part.features, f"dataset '{self.name}' ({split} split)")

    def capped(self, max_samples: int | None, seed: int) -> "DatasetSplits":
        """Train and test cut to at most `max_samples` examples each, chosen by a seeded
        permutation (apply before `with_validation`: the validation examples are not capped)."""
        if max_samples is None:
            return self
        return replace(
            self,
            train=random_subset(self.train, max_samples, seed),
            test=random_subset(self.test, max_samples, seed + 1),
            info=dict(self.info),
        )

    def with_validation(self, validation_size: int | float, seed: int) -> "DatasetSplits":
        """`validation_size` training examples (an int count, or a float fraction of the training
        split) moved to `validation`, chosen by a permutation seeded with `seed`; both parts keep
        the training split's order. 0 returns the splits unchanged.

        Raises ConfigError (naming dataset.validation_size) for a size that leaves no example on
        either side.
        """
        count = validation_count(validation_size, len(self.train))
        if count == 0:
            return self
        generator = torch.Generator().manual_seed(seed)
        held_out = torch.zeros(len(self.train), dtype=torch.bool)
        held_out[torch.randperm(len(self.train), generator=generator)[:count]] = True
        return replace(
            self,
            train=self.train.subset(torch.nonzero(~held_out).flatten()),
            info=dict(self.info),
            validation=self.train.subset(torch.nonzero(held_out).flatten()),
        )


def validation_count(validation_size: Any, num_train: int) -> int:
    """The number of examples `dataset.validation_size` holds out of `num_train` training ones.

    An int is a count in [0, num_train); a float in (0, 1) a fraction, rounded to the nearest
    count, which must be at least 1 and leave at least one training example. 0 (or 0.0) is none.
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
        raise ConfigError(
            f"dataset.validation_size={validation_size!r} cannot be held out of the {num_train} "
            f"training examples: set it to a count in [0, {num_train}) or a fraction in (0, 1) "
            f"that keeps at least one example on each side (e.g. dataset.validation_size=0.1; "
            f"0 means no validation split)."
        )
    return count


def random_subset(dataset: ArrayDataset, max_samples: int, seed: int) -> ArrayDataset:
    """At most `max_samples` examples of `dataset`, drawn without replacement (seeded)."""
    if max_samples >= len(dataset):
        return dataset
    generator = torch.Generator().manual_seed(seed)
    return dataset.subset(torch.randperm(len(dataset), generator=generator)[:max_samples])


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
