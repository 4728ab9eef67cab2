"""Balls-in-bins batches (random allocation): each epoch, every example goes into one of the
epoch's k = ceil(1 / q) batches, chosen uniformly at random, independently of every other example
and of earlier epochs (Chua et al., AISTATS 2025; Feldman and Shenfeld 2025, "Privacy
amplification by random allocation").

It gives the epoch structure users want from shuffling (each example exactly once per epoch) with
an epsilon close to Poisson sampling's instead of the unamplified shuffle charge: at sigma 1,
delta 1e-4, 10 steps an epoch, 3 epochs, 3.28 (Poisson by PLD 3.40; shuffled batches 18.2).

**Neighbouring relation: add/remove one example.** An example's batch is drawn on its own, so
adding one draws one more batch index and leaves every other example where it was. Accounting:
`dptrain.accounting.random_allocation` (an upper bound, epochs composed in RDP); the realised
batch size varies (Binomial(N, 1/k)), and the averaged gradient divides by the public expected
size N / k, never the realised one. q is recorded as 1 / k exactly, so the expected batch size
q N is that public divisor.

The index stream is `BallsInBinsBatchSampler`: an epoch's allocation is N uniform draws, kept
until the epoch ends (a mid-epoch resume continues the same allocation when it was saved, which
only reproducible randomness does; otherwise a resume must start at an epoch boundary, as with
shuffled batches). Over several ranks, every rank draws the same allocation and keeps its share
(`dptrain.data.sharding`); in secure mode each rank draws only the bins of its own examples, from
its own CSPRNG, which is the same allocation's distribution (each example's bin is its own draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dptrain.data.sampling import ShuffleBatchSampler, ShuffleDataLoader
from dptrain.privacy.selection.base import LoaderContext, Selection
from dptrain.randomness import uniform


class BallsInBinsBatchSampler(ShuffleBatchSampler):
    """Batches of a random allocation of range(num_samples) into `steps` = ceil(1 / q) bins per
    epoch: batch j of an epoch holds the examples whose drawn bin is j (sorted; possibly empty).

    The allocation of an epoch is kept in the same place as a shuffle's permutation (so saving,
    resuming and drawing ahead work as for `ShuffleBatchSampler`): `_orders[epoch]` is the list
    of the N examples' bins.
    """

    mechanism = "sampling='balls_in_bins'"
    #: (the allocation list, the same as a tensor [N]) of the epoch drawn from last: made once an
    #: epoch, not once a batch
    _as_tensor: tuple[list[int], torch.Tensor] | None = None

    #: each example's bin is its own draw (secure rank shares draw only their own examples')
    draws_per_example = True

    def _draw_epoch(self) -> list[int]:
        """A new epoch's allocation: the bin of each example, uniform in [0, steps), [N]; the
        bins drawn for `draws_for(range(N))`, the others (another rank's examples, in secure
        mode) -1, in no batch of this rank."""
        examples = self.draws_for(torch.arange(self.num_samples))
        draws = uniform(len(examples), self.generator, self.secure)  # [n] in [0, 1)
        bins = torch.full((self.num_samples,), -1, dtype=torch.long)
        bins[examples] = torch.clamp((draws * self.steps).long(), max=self.steps - 1)
        return bins.tolist()

    def draw_batch(self) -> list[int]:
        """The next batch: the examples allocated to bin (batches_drawn mod steps) of its epoch."""
        epoch, position = divmod(self.batches_drawn, self.steps)
        order = self._order(epoch)
        if self._as_tensor is None or self._as_tensor[0] is not order:
            self._as_tensor = (order, torch.tensor(order))
        self.batches_drawn += 1
        return (self._as_tensor[1] == position).nonzero().flatten().tolist()


class BallsInBinsDataLoader(ShuffleDataLoader):
    """A DataLoader of balls-in-bins batches (see `BallsInBinsBatchSampler`)."""

    sampler_class = BallsInBinsBatchSampler


@dataclass(frozen=True)
class BallsInBins(Selection):
    """k = ceil(1 / q) batches an epoch, each example in one of them uniformly at random."""

    kind: str = "balls_in_bins"

    steps_follow_batches: ClassVar[bool] = True
    epoch_bound: ClassVar[bool] = True
    accounting_kind: ClassVar[str] = "balls_in_bins"

    def __post_init__(self) -> None:
        super().__post_init__()
        # q = 1 / k exactly: the expected batch N / k is the public divisor of the average
        object.__setattr__(self, "sample_rate", 1.0 / self.steps_per_epoch)

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        loader = BallsInBinsDataLoader.from_data_loader(
            data_loader, sample_rate=self.sample_rate, generator=context.generator,
            secure=context.secure)
        return context.shard(loader, data_loader)


__all__ = ["BallsInBins", "BallsInBinsBatchSampler", "BallsInBinsDataLoader"]
