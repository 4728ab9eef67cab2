"""Opacus's ``opacus.data_loader``: DPDataLoader with ``from_data_loader(distributed=...,
generator=...)`` over dptrain's Poisson loaders."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from dptrain.data.distributed import DistributedDPDataLoader
from dptrain.data.sampling import DPDataLoader as CoreDPDataLoader


class DPDataLoader(CoreDPDataLoader):
    """dptrain's Poisson DataLoader; ``from_data_loader`` takes Opacus's keywords."""

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, distributed: bool = False,  # type: ignore[override]
                         generator: torch.Generator | None = None, **kwargs: Any
                         ) -> CoreDPDataLoader:
        """A Poisson loader at q = batch_size / N over `data_loader`'s dataset; distributed=True:
        each rank samples its own shard (dptrain's DistributedDPDataLoader). Without it the loader
        is an instance of this class, as Opacus code checks (`isinstance(loader, DPDataLoader)`)."""
        if distributed:
            return DistributedDPDataLoader.from_data_loader(data_loader, generator=generator,
                                                            **kwargs)
        return super().from_data_loader(data_loader, generator=generator, **kwargs)


__all__ = ["DPDataLoader"]
