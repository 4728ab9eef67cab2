"""The explicit private step: one logical batch and its record in, one noisy step and its charge out.

    charge = private_step(optimizer, batch, max_physical_batch_size, forward_backward, record)

The logical batch (what the private loader handed out: a Poisson sample or a shuffled batch) is
split along dim 0 into physical chunks of at most `max_physical_batch_size` rows (None: one
chunk). For each chunk `forward_backward(chunk)` runs the forward and backward passes, and the
optimizer clips the chunk's per-sample gradients into the running clipped sum
(`accumulate_chunks`: `DPOptimizer.clip_and_accumulate`). Then the optimizer releases the batch
once (`DPOptimizer.release(record)`): noise added once, one step of the wrapped optimizer, one
`Charge` made from the batch's record (dptrain.data.batch_record: the q it was drawn with), which
the accountant records. The step boundary is this call.

An empty chunk (an empty Poisson batch or shard) is not passed to `forward_backward`, except to
keep the ranks of a model fully sharded over two or more ranks in step (FSDP's parameter gathers
are collectives): their chunk counts are evened out, a rank with fewer chunks running padding
passes on empty ones (`forward_backward` must then run the forward and backward of the empty
chunk; the module make_private returned runs it on a placeholder row whose gradient it discards).

Loops that call `optimizer.step()` themselves release through the same `release`: the Hugging
Face Trainer integration clips its chunks with `accumulate_chunks` and the Trainer's step releases
the batch; `dptrain.BatchMemoryManager` keeps a user's own loop working the Opacus way (each
chunk's `step()` accumulates, the last one releases).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dptrain.data.batch_record import BatchRecord
from dptrain.data.virtual import in_lockstep, is_empty, pads_passes, split_batch
from dptrain.privacy.charge import Charge

__all__ = ["Charge", "accumulate_chunks", "private_step"]


def accumulate_chunks(optimizer: Any, batch: Any, max_physical_batch_size: int | None,
                      forward_backward: Callable[[Any], int]) -> int:
    """Clip the per-sample gradients of every physical chunk of the logical `batch` into the
    optimizer's clipped sum (nothing is released). Returns the rows of the batch (examples).

    `forward_backward(chunk)` computes the loss of a physical chunk and calls backward on it,
    returning the chunk's number of rows; it gets an empty chunk only for a padding pass (see
    the module docstring).
    """
    chunks = in_lockstep(split_batch(batch, max_physical_batch_size)
                         if max_physical_batch_size else [batch], optimizer)
    padding = pads_passes(optimizer)
    rows = 0
    for chunk in chunks:
        if is_empty(chunk) and not padding:
            continue  # nothing to clip, no rank to keep in step
        optimizer.original_optimizer.zero_grad(set_to_none=True)  # the clipped sum stays
        rows += forward_backward(chunk)
        optimizer.clip_and_accumulate()
    return rows


def private_step(optimizer: Any, batch: Any, max_physical_batch_size: int | None,
                 forward_backward: Callable[[Any], int],
                 record: BatchRecord | None = None) -> Charge:
    """One DP-SGD step of `optimizer` (a DPOptimizer) on the logical `batch`.

    `record` is the batch's record (`loader.last_record()`; None: the batch the optimizer's
    private loader handed out last, or, without one, the optimizer's own q). Returns what the
    step charged, with the rows of the batch this process trained on. On an error the partial
    clipped sum is discarded (nothing of the batch is released) and the error propagates.
    """
    try:
        rows = accumulate_chunks(optimizer, batch, max_physical_batch_size, forward_backward)
        return optimizer.release(record, batch_size=rows)
    except BaseException:
        optimizer.discard_partial_batch()
        raise
