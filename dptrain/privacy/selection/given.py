"""The Python caller's own loader, kept as it is (make_private only; the CLI never builds one).

"given": any loader, accounted as if Poisson-sampled: NOT a guarantee (the engine warns).
"given_shuffle": a loader that provably puts each example in at most one batch per pass
(dptrain.data.given_shuffle), charged as shuffled batches (one pass = one epoch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dptrain.data.given_shuffle import GivenShuffleLoader
from dptrain.errors import ConfigError
from dptrain.privacy.selection.base import LoaderContext, Selection
from dptrain.privacy.selection.shuffle import Shuffle, refuse_distributed_given_batches


@dataclass(frozen=True)
class Given(Selection):
    """The caller's loader, charged as Poisson sampling at q = batch_size / N (no proof)."""

    kind: str = "given"

    command: ClassVar[bool] = False
    proven: ClassVar[bool] = False
    supports_adaptive_clipping: ClassVar[bool] = True
    accounting_kind: ClassVar[str] = "given"
    ledger_words: ClassVar[str] = "the caller's loader (no amplification proof)"
    #: get_epsilon's warning
    warning: ClassVar[str] = ("The data loader does not use Poisson sampling (allow_non_poisson="
                              "True): the epsilon assumes Poisson sampling and is NOT a proven "
                              "guarantee for this run.")

    def check_distributed(self, context: LoaderContext) -> None:
        raise refuse_distributed_given_batches()

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        if not context.allow_non_poisson:
            raise ConfigError("poisson_sampling=False: the privacy accounting assumes Poisson "
                              "sampling; use sampling=\"shuffle\" (fixed-size batches of a shuffle, "
                              "accounted without amplification), or pass allow_non_poisson=True to "
                              "train on your own loader anyway (get_epsilon will then warn that the "
                              "epsilon is not a guarantee).")
        if context.rate_schedule is not None:
            raise ConfigError("sample_rate_schedule needs poisson_sampling=True: a fixed-batch "
                              "loader cannot follow a sample-rate schedule.")
        return data_loader


@dataclass(frozen=True)
class GivenShuffle(Shuffle):
    """The caller's loader kept, each of its passes charged as one shuffled epoch."""

    kind: str = "given_shuffle"

    command: ClassVar[bool] = False
    ledger_words: ClassVar[str] = ("the caller's loader, each example once per pass (accounted "
                                   "as shuffle)")

    def check_distributed(self, context: LoaderContext) -> None:
        raise refuse_distributed_given_batches()

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        return GivenShuffleLoader(data_loader, self.sample_rate)
