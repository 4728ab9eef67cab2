"""CIFAR-10 from the python pickle batches `<root>/cifar-10-batches-py/`.

`data_batch_1` ... `data_batch_5` (training, 50,000 images) and `test_batch` (10,000): each a
pickled dict with `data` (uint8 [n, 3072], channel-major 3x32x32 rows) and `labels`;
`batches.meta` holds `label_names`. With `download=True` torchvision fetches the archive. Inputs are
float32 [3, 32, 32] normalized per channel (mean 0.4914, 0.4822, 0.4465; std 0.2470, 0.2435,
0.2616).

The batches are unpickled by `_BatchUnpickler`, which resolves only the few numpy functions that
rebuild an array (`ALLOWED_GLOBALS`): a file that names any other class or function (which
unpickling would call: arbitrary code) is refused unread, so a folder received from someone else
cannot run code.
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
from dptrain.errors import ConfigError
from dptrain.data.datasets.synthetic import SyntheticSpec, synthetic_splits

FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)
TRANSFORM = Normalize(255.0, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
SPEC = SyntheticSpec(50_000, 10_000, (3, 32, 32), 10, 256, transform=TRANSFORM)


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as Python 3 pickles bytes at protocol 2, for the latin-1 codec only."""
    if encoding.replace("-", "").replace("_", "").lower() != "latin1":
        raise pickle.UnpicklingError(f"_codecs.encode with the {encoding!r} codec")
    return text.encode("latin-1")


_ARRAY = np.zeros(1, dtype=np.uint8)
# (module, name) -> the object: what pickled numpy arrays and bytes need, under the module paths
# numpy 1 and numpy 2 write (`numpy.core` became `numpy._core`).
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _ARRAY.__reduce__()[0]
       for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _ARRAY.__reduce_ex__(5)[0]
       for core in ("core", "_core")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _BatchUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ALLOWED_GLOBALS (numpy arrays, bytes), never code."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which no CIFAR-10 batch "
                                         "holds")
        return ALLOWED_GLOBALS[(module, name)]


def _unpickle(path: Path) -> dict:
    """The dict in the CIFAR-10 python batch `path`, with str keys; ConfigError naming the file
    when it is not one (or asks to run code)."""
    try:
        with path.open("rb") as handle:
            entry = _BatchUnpickler(handle, encoding="latin1").load()
    except Exception as error:  # unpickling raises many types on a damaged file
        raise ConfigError(
            f"dataset 'cifar10': {path} cannot be read as a CIFAR-10 python batch "
            f"({type(error).__name__}: {error}). A batch holds numpy arrays, lists and bytes "
            "only; any other object is refused unread, since unpickling it could run code. "
            "Replace the folder with the original cifar-10-batches-py (dataset.download=true "
            "fetches it)."
        ) from error
    if not isinstance(entry, dict):
        raise ConfigError(f"dataset 'cifar10': {path} holds a {type(entry).__name__}, not the "
                          "dict of a CIFAR-10 python batch; replace the folder with the original "
                          "cifar-10-batches-py (dataset.download=true fetches it).")
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
    split_key: bytes | None = None,
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
    return splits.capped(max_samples, split_key)
