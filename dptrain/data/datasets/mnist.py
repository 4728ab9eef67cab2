"""MNIST from its four IDX files, in torchvision's layout `<root>/MNIST/raw/` (or `<root>/`).

Each file may be plain (`train-images-idx3-ubyte`) or gzip-compressed (`...-ubyte.gz`). With
`download=True` missing files are fetched by torchvision. Inputs are float32 [1, 28, 28]
normalized with the usual MNIST mean 0.1307 and std 0.3081; 60,000 training and 10,000 test images.
"""

from __future__ import annotations

from pathlib import Path

from dptrain.data.datasets.base import (
    ArrayDataset,
    DatasetSplits,
    Normalize,
    download_failed,
    require_files,
)
from dptrain.data.datasets.idx import read_idx
from dptrain.data.datasets.synthetic import SyntheticSpec, synthetic_splits

TRANSFORM = Normalize(scale=255.0, mean=(0.1307,), std=(0.3081,))
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SPEC = SyntheticSpec(60_000, 10_000, (1, 28, 28), 10, 256, transform=TRANSFORM)


def find_idx_file(root: Path, stem: str) -> Path:
    """Where `stem` (plain or .gz) lies under `root/MNIST/raw` or `root`; the expected path if absent."""
    for folder in (root / "MNIST" / "raw", root):
        for name in (stem, stem + ".gz"):
            if (folder / name).exists():
                return folder / name
    return root / "MNIST" / "raw" / stem


def _download(root: Path) -> None:
    from torchvision.datasets import MNIST

    try:
        for train in (True, False):
            MNIST(str(root), train=train, download=True)
    except Exception as error:  # network errors come in many types
        raise download_failed("mnist", root, error) from error


def _read_split(root: Path, split: str) -> ArrayDataset:
    images_path, labels_path = (find_idx_file(root, stem) for stem in FILES[split])
    require_files("mnist", [images_path, labels_path], root)
    images = read_idx(images_path)
    return ArrayDataset(images.unsqueeze(1), read_idx(labels_path), TRANSFORM)


def load_mnist(
    root: str | Path,
    download: bool = False,
    synthetic: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    split_key: bytes | None = None,
    **_: object,
) -> DatasetSplits:
    """MNIST train/test splits read from `root` (downloaded first when `download`)."""
    if synthetic:
        return synthetic_splits("mnist", SPEC, seed, max_samples)
    root = Path(root).expanduser()
    if download:
        _download(root)
    splits = DatasetSplits("mnist", _read_split(root, "train"), _read_split(root, "test"), 10)
    return splits.capped(max_samples, split_key)
