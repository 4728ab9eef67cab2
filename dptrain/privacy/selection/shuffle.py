"""Shuffled batches: fixed-size batches of a fresh shuffle each epoch (every example in exactly
one batch per epoch), accounted without amplification under substitution
(dptrain.accounting.shuffle). The index stream is dptrain.data.sampling.ShuffleBatchSampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dptrain.data.sampling import ShuffleDataLoader
from dptrain.errors import ConfigError
from dptrain.privacy.selection.base import LoaderContext, Selection


def refuse_distributed_given_batches() -> ConfigError:
    """The refusal of a selection whose batches every rank would train on whole."""
    return ConfigError("poisson_sampling=False with a DistributedDataParallel or fully sharded "
                       "(FSDP) model: each rank would train on the same batches of the given "
                       "loader and the clipped sums, summed across ranks, would count every "
                       "example once per rank. Use poisson_sampling=True (each rank then "
                       "samples its own shard), or sampling='shuffle' (dptrain's shuffle of "
                       "the whole dataset, each rank training on its share of every batch).")


@dataclass(frozen=True)
class Shuffle(Selection):
    """Batches of round(q N) examples cut from one shuffle per epoch."""

    kind: str = "shuffle"

    steps_follow_batches: ClassVar[bool] = True
    epoch_bound: ClassVar[bool] = True
    accounting_kind: ClassVar[str] = "shuffle"

    @property
    def min_separation(self) -> int:
        """steps_per_epoch: one participation per epoch (two can still be adjacent across an
        epoch boundary, which the accounting charges)."""
        return self.steps_per_epoch

    def check_noise(self, strategy: Any) -> None:
        """Any noise: correlated noise is charged unamplified, one participation per epoch."""

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        """dptrain's shuffle of the whole dataset; over ranks every rank draws the same
        permutation (rank 0's generator) and keeps its share of each batch (dptrain.data.sharding:
        secure mode is refused there, one permutation cannot be drawn per rank)."""
        loader = ShuffleDataLoader.from_data_loader(data_loader, sample_rate=self.sample_rate,
                                                    generator=context.generator,
                                                    secure=context.secure)
        return context.shard(loader, data_loader)
