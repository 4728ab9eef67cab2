"""The explicit private step: one logical batch in, one noisy optimizer step out.

    charge = private_step(optimizer, batch, max_physical_batch_size, forward_backward)

The logical batch (what the private loader handed out: a Poisson sample or a shuffled batch) is
split along dim 0 into physical chunks of at most `max_physical_batch_size` rows (None: one
chunk). For each chunk `forward_backward(chunk)` runs the forward and backward passes, and the
optimizer clips the chunk's per-sample gradients into the running clipped sum
(`DPOptimizer.clip_and_accumulate`). Then noise is added once and the wrapped optimizer steps
once (`DPOptimizer.step`), which charges the accountant one step. Nothing is inferred from the
accountant and nothing is signalled through the loader: the step boundary is this call. An empty
chunk (an empty Poisson batch or shard) is not passed to `forward_backward`, except to keep the
ranks of a model fully sharded over two or more ranks in step (FSDP's parameter gathers are
collectives): their chunk counts are evened out, a rank with fewer chunks running padding passes
on empty ones (`forward_backward` must then run the forward and backward of the empty chunk; the
module make_private returned runs it on a placeholder row whose gradient it discards).
`dptrain.BatchMemoryManager` keeps the user's own loop working the older way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dptrain.data.virtual import in_lockstep, is_empty, pads_passes, split_batch


@dataclass(frozen=True)
class Charge:
    """What one private step charged: the noise multiplier sigma and sample rate q the
    accountant recorded for it, and the rows of the logical batch (examples)."""

    noise_multiplier: float
    sample_rate: float
    batch_size: int


def private_step(optimizer: Any, batch: Any, max_physical_batch_size: int | None,
                 forward_backward: Callable[[Any], int]) -> Charge:
    """One DP-SGD step of `optimizer` (a DPOptimizer) on the logical `batch`.

    `forward_backward(chunk)` computes the loss of a physical chunk and calls backward on it,
    returning the chunk's number of rows; it gets an empty chunk only for a padding pass (see
    the module docstring). On an error the partial clipped sum is discarded (nothing of the
    batch is released) and the error propagates.
    """
    chunks = in_lockstep(split_batch(batch, max_physical_batch_size)
                         if max_physical_batch_size else [batch], optimizer)
    padding = pads_passes(optimizer)
    rows = 0
    try:
        for chunk in chunks:
            if is_empty(chunk) and not padding:
                continue  # nothing to clip, no rank to keep in step
            optimizer.original_optimizer.zero_grad(set_to_none=True)  # the clipped sum stays
            rows += forward_backward(chunk)
            optimizer.clip_and_accumulate()
        optimizer.step()
    except BaseException:
        optimizer.discard_partial_batch()
        raise
    sigma, q = optimizer.last_charge
    return Charge(noise_multiplier=sigma, sample_rate=q, batch_size=rows)
