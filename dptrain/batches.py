"""What a batch is, once: the rules every part that moves, cuts or feeds a batch follows.

A collated batch of B examples is either

* a sequence `(x, y)` (torch's `default_collate` of `(input, target)` items; a list or tuple,
  `x = batch[0]`, `y = batch[-1]`), the model called as `model(x)`; or
* a mapping `{name: Tensor}` (a dict, a Hugging Face `BatchEncoding`: `input_ids`,
  `attention_mask`, `labels`), every tensor with the examples along dim 0 (leading size B), the
  targets under `labels` and the model called with the rest as keywords:
  `model(input_ids=..., attention_mask=...)`.

The loop (dptrain.train.loop), the physical chunks of a logical batch (`split_batch`,
dptrain.data.virtual), evaluation and the audit all read a batch through these functions, and a
job's `loss_step(model, batch)` (dptrain.losses) turns one into per-example losses.

Why a mapping's tensors must all have B rows: a logical batch is cut into physical chunks along
dim 0, and a tensor of another leading size would go whole into every chunk (the same rows
trained on several times in one step: one example's gradient clipped more than once). It is
refused (`ConfigError`, naming the key) instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.errors import ConfigError

LABELS = "labels"   # the key of a mapping batch's targets (Hugging Face's name)


def is_mapping(batch: Any) -> bool:
    """Whether `batch` is a mapping batch (`{name: Tensor}`), not an `(x, y)` sequence."""
    return isinstance(batch, Mapping)


def _first_rows(batch: Any) -> int | None:
    """dim 0 of the first tensor found in `batch` (tensor / sequence / mapping), or None."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, Mapping) else \
        batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _first_rows(item)
        if size is not None:
            return size
    return None


def rows(batch: Any) -> int | None:
    """B, the examples of a collated batch (the leading size of its first tensor); None when it
    holds no tensor with a dimension. ConfigError for a mapping batch whose tensors disagree on
    their leading size (see the module docstring)."""
    size = _first_rows(batch)
    if size is not None and isinstance(batch, Mapping):
        for key, value in batch.items():
            if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != size):
                shape = tuple(value.shape)
                raise ConfigError(
                    f"the batch's {key!r} has shape {shape}, but the batch holds {size} examples "
                    f"(the leading size of its first tensor): every tensor of a mapping batch "
                    f"must have one row per example along dim 0, so that cutting the batch into "
                    f"physical chunks (max_physical_batch_size) gives each example to one chunk. "
                    f"Make the dataset's items hold only per-example tensors (the collate "
                    f"function stacks them), and pass shared values some other way.")
    return size


def slice_rows(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows [start, stop) of every tensor of `batch` whose dim 0 is `size`; other leaves as is.
    A mapping comes back as a dict (a `BatchEncoding`'s keys and tensors kept)."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_rows(b, start, stop, size) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_rows(b, start, stop, size) for b in batch)
    if isinstance(batch, Mapping):
        return {k: slice_rows(v, start, stop, size) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor on `device` (the same structure; a mapping as a dict)."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def inputs_and_targets(batch: Any) -> tuple[Any, Tensor]:
    """(the model's inputs, the targets) of a collated batch: `(x, y)` of a sequence; of a
    mapping, (its other entries as a dict, `batch["labels"]`). ConfigError for a mapping
    without labels, or a sequence of fewer than two parts."""
    if isinstance(batch, Mapping):
        if LABELS not in batch:
            raise ConfigError(
                f"a mapping batch (keys {', '.join(map(repr, batch))}) has no {LABELS!r}: each "
                f"example's loss needs its targets. Put them under {LABELS!r} in the dataset's "
                f"items (a causal LM's labels are its token ids, -100 where no loss is counted), "
                f"or give the job a loss_step(model, batch) that finds them.")
        return {k: v for k, v in batch.items() if k != LABELS}, batch[LABELS]
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[0], batch[-1]
    raise ConfigError(
        f"a batch of type {type(batch).__name__} is neither (inputs, targets) nor a mapping with "
        f"{LABELS!r}: make the dataset's items (x, y) pairs or dicts of tensors, or give the job "
        f"a loss_step(model, batch) that reads it.")


def with_targets(batch: Any, targets: Tensor) -> Any:
    """`batch` with its targets replaced by `targets` (same rows): `(x, targets)`, or the mapping
    with `labels` replaced."""
    if isinstance(batch, Mapping):
        return {**batch, LABELS: targets}
    return (batch[0], targets)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """The model's output on a batch's inputs (`inputs_and_targets`): `model(**inputs)` for a
    mapping, else `model(inputs)`."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)
