"""Cyclic Poisson sampling: the N examples split once into `groups` groups (each example's group
drawn uniformly and independently), group t mod groups Poisson-sampled at rate groups * q at
step t: each example at most once every `groups` steps, as banded correlated noise needs
(dptrain.data.cyclic_sampling holds the sampler; the accounting is amplified banded MF,
add/remove: dptrain.accounting.events)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dptrain.data.cyclic_sampling import CyclicPoissonDataLoader, check_groups
from dptrain.errors import ConfigError
from dptrain.privacy.selection.base import LoaderContext, Selection
from dptrain.privacy.selection.poisson import check_banded_separation


@dataclass(frozen=True)
class CyclicPoisson(Selection):
    """`groups` groups, group t mod groups Poisson-sampled at step t (rate groups * q)."""

    kind: str = "cyclic_poisson"

    amplified: ClassVar[bool] = True
    takes_groups: ClassVar[bool] = True
    steps_follow_batches: ClassVar[bool] = True
    accounting_kind: ClassVar[str] = "cyclic_poisson"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_groups(self.groups, self.sample_rate)

    @property
    def min_separation(self) -> int:
        """`groups`: an example takes part at most once every `groups` steps (exact)."""
        return self.groups

    def parameters(self) -> dict[str, Any]:
        return {"sampling": self.kind, "sampling_groups": self.groups}

    def check_noise(self, strategy: Any) -> None:
        check_banded_separation(self, strategy)

    def check_distributed(self, context: LoaderContext) -> None:
        if context.sharded:
            raise ConfigError(
                "privacy.sampling=cyclic_poisson (which banded and BLT noise use) with a fully "
                "sharded (FSDP) model is not supported: the sharded optimizer's per-rank noise has "
                "not been verified with cyclic groups and noise buffers. Use hardware=ddp, or "
                "privacy.noise=independent with privacy.sampling=poisson under hardware=fsdp.")

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        loader = CyclicPoissonDataLoader.from_data_loader(
            data_loader, sample_rate=self.sample_rate, groups=self.groups,
            generator=context.generator, secure=context.secure)
        return context.shard(loader, data_loader)
