"""Tiny dataset files in the real on-disk formats, written by the tests: MNIST IDX files,
CIFAR-10 python pickle batches, the aclImdb folder and its .tar.gz archive (shared by the
loader tests and the `dptrain` command tests)."""

import gzip
import io
import pickle
import struct
import tarfile

from pathlib import Path

import numpy as np

STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX encoding of a uint8 array: 0, 0, type 0x08, ndim, big-endian uint32 sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    return header + array.astype(np.uint8).tobytes()


def write_mnist(folder: Path, n_train: int = 6, n_test: int = 4, compress: bool = False,
                seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The four MNIST IDX files (plain or .gz) of random uint8 images [n, 28, 28] and labels in
    `folder`; returns split -> (images, labels)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        arrays[split] = (images, labels)
        for stem, array in zip(STEMS[split], (images, labels)):
            data = idx_bytes(array)
            if compress:
                (folder / f"{stem}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / stem).write_bytes(data)
    return arrays


CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                 "truck"]


def write_cifar10(root: Path, per_batch: int = 3, seed: int = 0,
                  protocol: int = pickle.DEFAULT_PROTOCOL) -> dict[str, dict]:
    """root/cifar-10-batches-py/: data_batch_1..5 and test_batch (dicts with uint8 data
    [per_batch, 3072] and labels, pickled at `protocol`) and batches.meta; returns batch name ->
    dict."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, per_batch).tolist(),
            b"filenames": [b"x.png"] * per_batch,
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=protocol))
        batches[name] = entry
    meta = {
        b"label_names": [n.encode() for n in CIFAR10_NAMES],
        b"num_cases_per_batch": per_batch,
        b"num_vis": 3072,
    }
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=protocol))
    return batches


REVIEWS = {
    ("train", "pos"): ["A great, great film.<br />Loved it!", "great acting and a great plot"],
    ("train", "neg"): ["Awful film. Boring plot", "boring, BORING"],
    ("test", "pos"): ["great fun unseen words"],
    ("test", "neg"): ["awful awful"],
}


def write_acl_imdb(root: Path) -> None:
    """root/aclImdb/{train,test}/{pos,neg}/<i>_7.txt holding REVIEWS."""
    for (split, label), texts in REVIEWS.items():
        folder = root / "aclImdb" / split / label
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_7.txt").write_text(text, encoding="utf-8")


def write_archive(root: Path) -> None:
    """root/aclImdb_v1.tar.gz holding REVIEWS in the aclImdb layout."""
    with tarfile.open(root / "aclImdb_v1.tar.gz", "w:gz") as tar:
        for (split, label), texts in REVIEWS.items():
            for i, text in enumerate(texts):
                data = text.encode("utf-8")
                info = tarfile.TarInfo(f"aclImdb/{split}/{label}/{i}_7.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
