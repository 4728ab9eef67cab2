"""Which rows of a file a run keeps (`dataset.max_samples`) and holds out (`dataset.validation_size`).

Epsilon is a bound for neighbouring training sets. For it to hold for a row of the file the
user hands over, the rows chosen around that row must not depend on it: neighbouring files must
give neighbouring training sets. A permutation seeded with `train.seed` (which the ledger
publishes) does not do that: removing one row renumbers the others, and on the digits with seed
0 the training set after `validation_size=0.2` then changed in 455 rows.

So each row's fate is decided by a draw of its own: a keyed hash (BLAKE2b, a pseudo-random
function) of its stored contents, never of its position, with a secret `split key` of 32 bytes
from OS entropy. The key is never written to the config, the ledger, the metrics or the result:
a run keeps it in its checkpoints (private resume state), from which a resume reads it back, so
that a resumed run trains on the same rows. Rows with the same contents get the same draw.

- A fraction f (`validation_size=0.2`) holds out each row whose draw is below f, independently
  of every other row: adding or removing a row of the file changes the training set by that
  row alone (row or user level).
- A count c (`validation_size=100`) holds out the c rows with the smallest draws: removing a row
  of the file removes exactly one row from the training set (that row, or the one that takes
  its place in the validation split). Removing one user's several rows would move rows of other
  users, so a count is refused with a user column (a fraction is not).
- `max_samples=m` keeps the m rows with the smallest draws (a uniformly random subset, the key
  being secret): removing a kept row brings the next one in, so the training sets of
  neighbouring files differ by one substituted row. Any subset of a fixed size couples rows
  that way; `cap_steps` says so in the ledger.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from dptrain.errors import ConfigError

SPLIT_KEY_BYTES = 32
# One draw per purpose: the cap of the training split, of the test split, and the validation
# split are independent of each other (each hash is prefixed with its purpose).
VALIDATION, TRAIN_CAP, TEST_CAP = "validation", "train cap", "test cap"
_DRAW_BITS = 63   # draws are int64 in [0, 2**63): comparisons and ranks stay exact integers
_KEY_WORDS = ("a secret key drawn from OS entropy and kept only in the run's checkpoints, "
              "never in a published file")


def new_split_key() -> bytes:
    """A fresh split key: SPLIT_KEY_BYTES bytes from the OS's cryptographic source."""
    return secrets.token_bytes(SPLIT_KEY_BYTES)


def check_split_key(key: object) -> bytes:
    """`key` when it is a split key (bytes of length SPLIT_KEY_BYTES); ConfigError otherwise."""
    if not isinstance(key, bytes) or len(key) != SPLIT_KEY_BYTES:
        raise ConfigError(
            f"split_key must be {SPLIT_KEY_BYTES} bytes (dptrain.data.datasets.selection."
            f"new_split_key(), or the key a checkpoint saved: dptrain.train.checkpoint."
            f"saved_split_key(path)); got {type(key).__name__}. It is not a config key: it "
            f"decides which rows are trained on and must stay out of published files.")
    return key


def split_key_or_new(key: bytes | None) -> bytes:
    """`key` checked (`check_split_key`), or a fresh key when it is None."""
    return check_split_key(key) if key is not None else new_split_key()


def row_draws(records: Iterable[bytes], key: bytes, purpose: str) -> torch.Tensor:
    """int64 `[N]`: each record's draw in [0, 2**63), a keyed hash of `purpose` and its bytes.

    A record is the bytes of one row's contents (`array_records`, `text_records`): the draw of
    a row depends on that row and the key alone."""
    check_split_key(key)
    prefix = purpose.encode("utf-8") + b"\0"
    values = [int.from_bytes(hashlib.blake2b(prefix + record, key=key, digest_size=8).digest(),
                             "little") >> (64 - _DRAW_BITS) for record in records]
    return torch.tensor(values, dtype=torch.int64)


def array_records(features: torch.Tensor, labels: torch.Tensor) -> Iterator[bytes]:
    """The stored bytes of each row, one at a time: `features[i]` then `labels[i]` (any shapes,
    N rows).

    A user id is not part of a row's record: users are numbered in order of first appearance,
    so removing one user renumbers the others."""
    count = len(labels)
    flat_x = features.detach().cpu().contiguous().reshape(count, -1).numpy()
    flat_y = labels.detach().cpu().contiguous().reshape(count, -1).numpy()
    x_bytes = np.ascontiguousarray(flat_x).view(np.uint8).reshape(count, -1)
    y_bytes = np.ascontiguousarray(flat_y).view(np.uint8).reshape(count, -1)
    return (x_bytes[i].tobytes() + b"\0" + y_bytes[i].tobytes() for i in range(count))


def text_records(*columns: Sequence[object] | None) -> Iterator[bytes]:
    """The contents of each row of a text file as bytes, one at a time: its values in `columns`
    (None: a column the file has not), each value length-prefixed so that no two different rows
    give the same bytes."""
    present = [c for c in columns if c is not None]
    count = len(present[0]) if present else 0

    def encode(value: object) -> bytes:
        data = str(value).encode("utf-8")
        return len(data).to_bytes(8, "little") + data

    return (b"".join(encode(c[i]) for c in present) for i in range(count))


def keep_smallest(draws: torch.Tensor, count: int) -> torch.Tensor:
    """int64 indices (in file order) of the `count` rows with the smallest `draws` (int64 [N]);
    all of them when `count >= N`."""
    if count >= len(draws):
        return torch.arange(len(draws))
    order = torch.argsort(draws, stable=True)   # equal draws: equal rows, either one will do
    return torch.sort(order[:count]).values


def below(draws: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool `[N]`: the rows whose draw is below `fraction` of the draws' range, each row
    independently (probability `fraction` for a secret key)."""
    return draws < int(fraction * 2 ** _DRAW_BITS)


def cap_steps(max_samples: int | None, kept: int, rows: int) -> tuple[str, ...]:
    """The ledger's `private_preprocessing` sentence of `dataset.max_samples` cutting a training
    file of `rows` rows to `kept` (none when nothing was cut)."""
    if max_samples is None or kept >= rows:
        return ()
    return (f"dataset.max_samples={max_samples} kept {kept} of the {rows} rows of the training "
            f"file, those with the smallest keyed hash of their contents ({_KEY_WORDS}): "
            "removing a kept row from the file brings the next row in, so neighbouring files "
            "give training sets that differ by one substituted row (removing one user's k "
            "kept rows brings k other rows in). Epsilon holds for a row of the training set; "
            "for a row of the file only by group privacy (at most 2 epsilon, with delta "
            "(1 + e^epsilon) delta). Set dataset.max_samples=null for epsilon to hold for a "
            "row of the file as stated."),


def describe_validation(validation_size: int | float, held_out: int, rows: int) -> str:
    """The ledger's `private_preprocessing` sentence of `dataset.validation_size` holding out
    `held_out` of `rows` training rows."""
    if isinstance(validation_size, float):
        how = (f"each row independently of the others, when a keyed hash of its contents "
               f"falls below {validation_size:g} ({_KEY_WORDS}): adding or removing a row of "
               "the file changes the training set by that row alone")
    else:
        how = (f"the {validation_size} rows with the smallest keyed hash of their contents "
               f"({_KEY_WORDS}): adding or removing a row of the file changes the training set "
               "by one row (that row, or the one that takes its place in the validation split)")
    return (f"dataset.validation_size={validation_size!r} held out {held_out} of the {rows} "
            f"training rows, {how}. Epsilon holds for a row of the file; the validation "
            "metrics computed on the held-out rows are not covered by it.")
