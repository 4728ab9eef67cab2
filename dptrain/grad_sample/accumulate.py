"""Per-pass accumulation of per-sample quantities (grad samples, squared norms).

Within one forward pass the uses of a layer SUM (shared weights, a recurrent layer's T steps);
across passes the per-sample rows CONCATENATE along dim 0 (each pass holds different examples, as
in gradient accumulation). :class:`PerPassStore` implements exactly that for any keyed tensors of
shape ``[B_pass, *shape]``; the ghost-clipping module reuses it for its ``[B]`` norms.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class _Chunk:
    """One pass's rows of one key; ``owned`` means we allocated it and may add into it in place."""

    value: Tensor
    owned: bool


class PerPassStore:
    """Keyed per-sample tensors, summed within a pass and concatenated across passes.

    Passes are ordered by their id (GradSampleModule numbers them in forward order, whatever the
    order in which a backward reaches them). :meth:`materialize` returns, per key, one
    tensor ``[sum of pass batch sizes, *shape]`` with zero rows for passes the key missed (a layer
    unused in that pass has zero gradient for those samples).
    """

    def __init__(self) -> None:
        self._passes: dict[int, int] = {}
        self._chunks: dict[Hashable, dict[int, _Chunk]] = {}

    def add(self, key: Hashable, pass_id: int, value: Tensor) -> None:
        """Add ``value`` (``[B_pass, *shape]``) to ``key``'s rows of pass ``pass_id``.

        ``value`` is never modified later (it may alias a tensor autograd still uses).
        """
        batch = value.shape[0]
        known = self._passes.setdefault(pass_id, batch)
        if known != batch:
            raise RuntimeError(f"pass {pass_id} has batch size {known}, got a value of {batch} rows")
        chunks = self._chunks.setdefault(key, {})
        chunk = chunks.get(pass_id)
        if chunk is None:
            chunks[pass_id] = _Chunk(value, owned=False)
        elif chunk.owned:
            chunk.value.add_(value)
        else:
            chunks[pass_id] = _Chunk(chunk.value + value, owned=True)

    def materialize(self) -> dict[Hashable, Tensor]:
        """Return ``{key: Tensor[B_total, *shape]}`` (contiguous) and keep views of it as chunks."""
        result = {}
        for key, chunks in self._chunks.items():
            parts = [self._part(chunks, pass_id, batch) for pass_id, batch in self._ordered_passes()]
            full = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=0)
            result[key] = full
            self._chunks[key] = self._as_views(full)
        return result

    def _ordered_passes(self) -> list[tuple[int, int]]:
        """``(pass_id, batch_size)`` in increasing pass id."""
        return sorted(self._passes.items())

    def _part(self, chunks: dict[int, _Chunk], pass_id: int, batch: int) -> Tensor:
        """The rows of one pass, zeros when the key got nothing in that pass."""
        if pass_id in chunks:
            return chunks[pass_id].value
        like = next(iter(chunks.values())).value
        return like.new_zeros((batch, *like.shape[1:]))

    def _as_views(self, full: Tensor) -> dict[int, _Chunk]:
        """Split a materialized tensor back into per-pass views (not owned: added out of place)."""
        views, start = {}, 0
        for pass_id, batch in self._ordered_passes():
            views[pass_id] = _Chunk(full[start : start + batch], owned=False)
            start += batch
        return views

    def batch_size(self) -> int:
        """Total number of samples over all passes seen since the last reset."""
        return sum(self._passes.values())

    def keys(self) -> Iterable[Hashable]:
        """Keys holding at least one pass."""
        return self._chunks.keys()

    def discard(self, key: Hashable) -> None:
        """Forget ``key``; forget the passes too once no key is left."""
        self._chunks.pop(key, None)
        if not self._chunks:
            self._passes.clear()

    def reset(self) -> None:
        """Forget everything."""
        self._chunks.clear()
        self._passes.clear()
