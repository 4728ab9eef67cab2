"""Opacus's ``opacus.data_loader``: DPDataLoader with ``from_data_loader(distributed=...,
generator=...)`` over dptrain's Poisson loaders."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from dptrain.data.distributed import DistributedDPDataLoader
from dptrain.data.sampling import DPDataLoader as CoreDPDataLoader
from dptrain.opacus._absent import absent


def opacus_sample_rate(data_loader: DataLoader) -> float:
    """Opacus's Poisson q for `data_loader`: 1 / len(data_loader), i.e. ceil(N / B) steps an
    epoch and N / ceil(N / B) expected examples a batch (dptrain's batch_size / N when the batch
    size B divides N, less otherwise)."""
    return 1.0 / len(data_loader)


def opacus_rate_applies(data_loader: DataLoader) -> bool:
    """Whether Opacus's q replaces dptrain's for `data_loader`: a plain, non-empty loader (not
    one already private, nor one with a DistributedSampler, whose batch_size dptrain reads as
    the global one)."""
    return (not isinstance(data_loader, CoreDPDataLoader)
            and not isinstance(getattr(data_loader, "sampler", None), DistributedSampler)
            and len(data_loader) > 0)


class DPDataLoader(CoreDPDataLoader):
    """dptrain's Poisson DataLoader; ``from_data_loader`` takes Opacus's keywords."""

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, distributed: bool = False,  # type: ignore[override]
                         generator: torch.Generator | None = None, **kwargs: Any
                         ) -> CoreDPDataLoader:
        """A Poisson loader at Opacus's q (`opacus_sample_rate`: 1 / len(data_loader)) over
        `data_loader`'s dataset, an instance of this class, as Opacus code checks
        (`isinstance(loader, DPDataLoader)`); distributed=True: each rank samples its own shard
        (dptrain's DistributedDPDataLoader, at dptrain's q)."""
        if distributed:
            return DistributedDPDataLoader.from_data_loader(data_loader, generator=generator,
                                                            **kwargs)
        if "sample_rate" not in kwargs and opacus_rate_applies(data_loader):
            kwargs["sample_rate"] = opacus_sample_rate(data_loader)
        return super().from_data_loader(data_loader, generator=generator, **kwargs)


_COLLATE = ("DPDataLoader.from_data_loader(loader): dptrain's Poisson loader collates each batch, "
            "an empty one included, itself")
CollateFnWithEmpty = absent("opacus.data_loader.CollateFnWithEmpty", _COLLATE)
wrap_collate_with_empty = absent("opacus.data_loader.wrap_collate_with_empty", _COLLATE)
shape_safe = absent("opacus.data_loader.shape_safe", _COLLATE)
dtype_safe = absent("opacus.data_loader.dtype_safe", _COLLATE)
switch_generator = absent(
    "opacus.data_loader.switch_generator",
    "DPDataLoader.from_data_loader(loader, generator=g): dptrain's loaders take their generator "
    "when built")

__all__ = ["CollateFnWithEmpty", "DPDataLoader", "dtype_safe", "shape_safe", "switch_generator",
           "wrap_collate_with_empty"]
