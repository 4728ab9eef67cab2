"""The link between a DPOptimizer and the private loader, for loops that call `step()` themselves.

A loop written for a plain optimizer (`for x, y in loader: ...; optimizer.step()`, Opacus's
`BatchMemoryManager`, the Hugging Face Trainer) never says which batch a step releases. The link
knows: it listens to the loader's hand-outs, gives `DPOptimizer.release` the record of the batch
handed out last (dptrain.data.batch_record), and refuses what would make the accountant charge
another mechanism than the one run:

- a step whose gradients include rows of two logical batches (gradients of a batch still pending,
  or an unreleased partial sum, when the next batch was handed out): two Poisson batches in one
  step are not one Poisson batch at q. Physical chunks of ONE logical batch are fine: no new batch
  is handed out between them;
- a step with no new batch from the private loader since the previous step (the loop iterates
  the original loader, or steps twice on one batch): that step was not sampled;
- with `one_batch_per_step` (cyclic Poisson, shuffled batches: the selection's
  `steps_follow_batches`), a step after two or more batches were handed out: step t must release
  batch t;
- a step releasing a record that is not the batch handed out last (a stale record).

With `refuse_at_backward` (dptrain.opacus: Opacus's point of refusal) the backward that would add a
second batch's rows to the first's is refused already. An optimizer without a private loader is
`Unlinked`: nothing to check, no record (q from its plan or schedule).
"""

from __future__ import annotations

from typing import Any

from dptrain.data.batch_record import BatchRecord, last_record

#: why gradients of two logical batches are refused (`when`: what would mix them)
TWO_BATCHES = (
    "per-sample gradients (or a partial clipped sum of skipped steps) of an earlier batch were "
    "still pending when the private loader handed out the next batch, so {when} two logical "
    "batches as one. Two Poisson batches accumulated into one step are not one Poisson-sampled "
    "batch at q, and the accountant would under-charge them. Call optimizer.zero_grad() before "
    "the forward of each batch and optimizer.step() once per batch; to process a large logical "
    "batch in pieces, use dptrain.BatchMemoryManager (or a larger batch size).")


class Unlinked:
    """The protocol of a loop that calls `step()` itself, with no private loader linked: the
    virtual-step signals only (every step is the caller's to account: nothing checked, no
    record).

    `skip_next`: the next `step()` only clips and accumulates (`signal_skip_step`: a non-final
    physical chunk of `BatchMemoryManager`); `last_step_skipped`: the last `step()` did, so its
    clipped sum waits for the logical batch's last chunk (`zero_grad` keeps it).
    """

    def __init__(self) -> None:
        self.skip_next = False
        self.last_step_skipped = False

    def record_to_release(self, record: BatchRecord | None) -> BatchRecord | None:
        """The record a step releases: the caller's (None: the optimizer's own q)."""
        return record

    def check_chunk(self) -> None:
        """Nothing of another batch can be pending: no batches are handed out."""

    def rows_cleared(self) -> None:
        """Per-sample rows were freed."""

    def sum_cleared(self) -> None:
        """The clipped sum was freed."""

    def released(self) -> None:
        """A step was released."""

    def restored(self) -> None:
        """A saved DP state was loaded (it sits between two steps)."""


class LoaderLink(Unlinked):
    """The protocol between `optimizer` (a DPOptimizer) and its private `loader` (module doc).

    Args:
        optimizer: the DPOptimizer whose steps release the loader's batches.
        loader: the private loader (`add_hand_out_listener`, `last_record`).
        one_batch_per_step: refuse a step after more than one batch was handed out.
        refuse_at_backward: refuse a backward adding a second batch's rows already.
    """

    def __init__(self, optimizer: Any, loader: Any, *, one_batch_per_step: bool = False,
                 refuse_at_backward: bool = False) -> None:
        super().__init__()
        self.optimizer, self.loader = optimizer, loader
        self.one_batch_per_step = bool(one_batch_per_step)
        self.refuse_at_backward = bool(refuse_at_backward)
        self.batches_since_step = 0        # batches handed out since the last real step
        self.earlier_rows_pending = False  # per-sample rows of an earlier batch not yet clipped
        self.earlier_sum_pending = False   # a partial clipped sum of an earlier batch
        loader.add_hand_out_listener(self.on_hand_out)

    def on_hand_out(self) -> None:
        """The loader handed the loop a batch: what is pending now belongs to an earlier one,
        and a step that releases it together with anything else is refused."""
        self.batches_since_step += 1
        optimizer = self.optimizer
        if optimizer.has_pending_sum():
            self.earlier_sum_pending = True
        if optimizer.module.per_sample_batch_size() > 0:
            self.earlier_rows_pending = True
            self._refuse_backward(f"DPOptimizer step {optimizer.steps_taken} refused at "
                                  "backward(): " + TWO_BATCHES.format(
                                      when="this backward would add to them"))

    def _refuse_backward(self, reason: str | None) -> None:
        """With `refuse_at_backward`, make the module's backward raise PrivacyError(`reason`)
        (None: allow it again); a source without `refuse_backward` (FSDP, user level) is
        refused at the step."""
        refuse = getattr(self.optimizer.module, "refuse_backward", None)
        if self.refuse_at_backward and refuse is not None:
            refuse(reason)

    def check_chunk(self) -> None:
        """PrivacyError (everything pending discarded) when the chunk being clipped would join
        rows of an earlier batch."""
        if self.earlier_rows_pending or self.earlier_sum_pending:
            self.optimizer.refuse(TWO_BATCHES.format(when="this step would release"))

    def rows_cleared(self) -> None:
        self.earlier_rows_pending = False
        self._refuse_backward(None)

    def sum_cleared(self) -> None:
        self.earlier_sum_pending = False

    def record_to_release(self, record: BatchRecord | None) -> BatchRecord | None:
        """The record of the batch the step releases: the batch handed out last (`record`, if
        given, must be it). PrivacyError, nothing released, for the misuse the module docstring
        lists."""
        refuse = self.optimizer.refuse
        if self.batches_since_step == 0:
            refuse("the private data loader returned by make_private handed out no batch since "
                   "the previous step, so this step's gradients were not computed on a sampled "
                   "batch (the loop iterates the original DataLoader, or steps twice on one "
                   "batch), yet the accountant would charge it as one. Iterate the data loader "
                   "returned by make_private and call optimizer.step() once per batch.")
        if self.one_batch_per_step and self.batches_since_step > 1:
            refuse(f"the private data loader handed out {self.batches_since_step} batches since "
                   "the previous step, but step t must release batch t of this loader (cyclic "
                   "Poisson sampling: the batch of group t mod groups; shuffled batches: a batch "
                   "of pass t // len(loader)): a skipped batch would let an example take part in "
                   "two steps that the accounting charges as one group or one epoch. Call "
                   "optimizer.step() once for every batch of the loader (an empty batch "
                   "included).")
        if self.earlier_sum_pending:
            refuse("the clipped sum accumulated by skipped steps (signal_skip_step) belongs to an "
                   "earlier batch than the one the private loader handed out last; a step "
                   "releases one logical batch. Use dptrain.BatchMemoryManager to split a logical "
                   "batch into physical chunks.")
        handed_out = last_record(self.loader)
        if record is not None and record != handed_out:
            refuse(f"the step was asked to release batch {record.index} of the private loader, "
                   f"but the batch it handed out last is batch "
                   f"{None if handed_out is None else handed_out.index}: a step releases the "
                   "gradients of the batch handed out last, and is charged at that batch's q. "
                   "Pass the record of the batch just received (loader.last_record()).")
        return handed_out

    def released(self) -> None:
        self.batches_since_step = 0

    def restored(self) -> None:
        # a saved state sits between two steps: the batches a resume draws again and discards
        # to replay the epoch (dptrain.train.loop) belong to steps already taken
        self.batches_since_step = 0


__all__ = ["LoaderLink", "TWO_BATCHES", "Unlinked"]
