"""The charge of one private step: what the accountant records for it.

`DPOptimizer.release` makes one `Charge` per noisy step, from the record of the batch it releases
(dptrain.data.batch_record); the engine's accountant is stepped with charges and nothing else
(`Accountant.step_charge`), and an accountant rebuilt from a run's charges (or from a ledger's
history, their runs) holds the same steps (`Accountant.from_charges`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Charge:
    """One noisy step as the accountant records it.

    Attributes:
        noise_multiplier: sigma, the noise std in units of the clipping sensitivity.
        sample_rate: q of the released batch (the batch record's; a caller's own loader: the
            plan's or the schedule's q).
        batch_size: rows of the logical batch this rank trained on (examples; None when the
            step does not know them: a loop that drives the optimizer itself).
        step: the step's index (0-based: the optimizer's steps taken before it).
        batch_index: the released batch's index in the selection's stream (its record's; None
            without a record), equal to `step` whenever every batch drawn is stepped on.
    """

    noise_multiplier: float
    sample_rate: float
    batch_size: int | None = None
    step: int | None = None
    batch_index: int | None = None


__all__ = ["Charge"]
