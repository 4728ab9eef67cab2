"""CIFAR-10 from the python pickle batches `<root>/cifar-10-batches-py/`.

`data_batch_1` ... `data_batch_5` (training, 50,000 images) and `test_batch` (10,000): each a
pickled dict with `data` (uint8 [n, 3072], channel-major 3x32x32 rows) and `labels`;
`batches.meta` holds `label_names`. With `download=True` torchvision fetches the archive. Inputs are
float32 [3, 32, 32] normalized per channel (mean 0.4914, 0.4822, 0.4465; std 0.2470, 0.2435,
0.2616).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from dptrain.data.datasets.base import (
    ArrayDataset,
    DatasetSplits,
    Normalize,
    download_failed,
    require_files,
)
from dptrain.data.datasets.synthetic import SyntheticSpec, synthetic_splits

FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)
TRANSFORM = Normalize(255.0, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
SPEC = SyntheticSpec(50_000, 10_000, (3, 32, 32), 10, 256, transform=TRANSFORM)


def _unpickle(path: Path) -> dict:
    with path.open("rb") as handle:
        entry = pickle.load(handle, encoding="latin1")
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in entry.items()}


def _read_batches(folder: Path, names: tuple[str, ...]) -> ArrayDataset:
    entries = [_unpickle(folder / name) for name in names]
    data = np.concatenate([np.asarray(e["data"], dtype=np.uint8) for e in entries])
    labels = np.concatenate(
        [np.asarray(e.get("labels", e.get("fine_labels")), dtype=np.int64) for e in entries]
    )
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))
    return ArrayDataset(images, torch.from_numpy(labels), TRANSFORM)


def _download(root: Path) -> None:
    from torchvision.datasets import CIFAR10

    try:
        CIFAR10(str(root), train=True, download=True)
    except Exception as error:  # network errors come in many types
        raise download_failed("cifar10", root, error) from error


def load_cifar10(
    root: str | Path,
    download: bool = False,
    synthetic: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    **_: object,
) -> DatasetSplits:
    """CIFAR-10 train/test splits read from `root` (downloaded first when `download`)."""
    if synthetic:
        return synthetic_splits("cifar10", SPEC, seed, max_samples)
    root = Path(root).expanduser()
    if download:
        _download(root)
    folder = root / FOLDER
    require_files(
        "cifar10", [folder / n for n in (*TRAIN_BATCHES, *TEST_BATCHES, "batches.meta")], root
    )
    classes = [
        n.decode() if isinstance(n, bytes) else str(n)
        for n in _unpickle(folder / "batches.meta")["label_names"]
    ]
    splits = DatasetSplits(
        "cifar10",
        _read_batches(folder, TRAIN_BATCHES),
        _read_batches(folder, TEST_BATCHES),
        len(classes),
        {"classes": list(classes)},
    )
    return splits.capped(max_samples, seed)
