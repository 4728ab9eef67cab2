"""Poisson sampling: each example joins each batch independently with probability q (amplified
accounting, add/remove). The index stream is dptrain.data.sampling.PoissonBatchSampler (sharded
over ranks by dptrain.data.sharding, as every selection's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dptrain.data.sampling import DPDataLoader
from dptrain.errors import ConfigError
from dptrain.privacy.selection.base import LoaderContext, Selection, noise_bands


def check_banded_separation(selection: Selection, strategy: Any) -> None:
    """ConfigError when banded noise of b bands meets (cyclic) Poisson sampling of fewer than b
    groups: an example could take part twice within b steps and the amplified accounting of
    banded MF would not hold."""
    bands = noise_bands(strategy)
    if bands is None or bands <= 1 or selection.groups >= bands:
        return
    raise ConfigError(
        f"privacy.noise=banded with {bands} bands needs each example to take part at most "
        f"once every {bands} steps, but privacy.sampling={selection.kind} with "
        f"{selection.groups} group(s) can sample it in consecutive steps. Leave "
        "privacy.sampling unset (banded noise then picks cyclic Poisson sampling with "
        f"{bands} groups), or set privacy.sampling=cyclic_poisson "
        f"privacy.sampling_groups={bands} (or more), or privacy.sampling=shuffle "
        "(accounted without amplification).")


@dataclass(frozen=True)
class Poisson(Selection):
    """Each example in each batch with probability q (`schedule`: q by step)."""

    kind: str = "poisson"

    poisson: ClassVar[bool] = True
    amplified: ClassVar[bool] = True
    takes_schedule: ClassVar[bool] = True
    supports_user_level: ClassVar[bool] = True
    supports_adaptive_clipping: ClassVar[bool] = True

    def check_noise(self, strategy: Any) -> None:
        """Banded noise needs more groups than Poisson has; BLT is charged unamplified."""
        check_banded_separation(self, strategy)

    def private_loader(self, data_loader: Any, context: LoaderContext) -> Any:
        loader = DPDataLoader.from_data_loader(data_loader, sample_rate=self.sample_rate,
                                               generator=context.generator, secure=context.secure,
                                               sample_rate_schedule=context.rate_schedule)
        return context.shard(loader, data_loader)
