"""Reader for the IDX format of the MNIST files (plain or gzip-compressed).

Layout: two zero bytes, a type code byte (0x08 = unsigned byte), the number of dimensions d, then
d big-endian uint32 sizes, then the values in row-major order.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from dptrain.errors import ConfigError

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> torch.Tensor:
    """The array stored in the IDX file `path` (`.gz` is decompressed), with its header's shape."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ConfigError(
            f"{path} is not an IDX file (bad magic number); delete it and re-download."
        )
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_DTYPES[raw[2]])
    count = int(np.prod(shape))
    offset = 4 + 4 * ndim
    if len(raw) < offset + count * dtype.itemsize:
        raise ConfigError(
            f"{path} is truncated (header says shape {shape}); delete it and re-download."
        )
    values = np.frombuffer(raw, dtype=dtype, count=count, offset=offset).reshape(shape)
    return torch.from_numpy(values.astype(dtype.newbyteorder("=")))
