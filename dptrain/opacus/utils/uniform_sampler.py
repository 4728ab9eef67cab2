"""Opacus's ``opacus.utils.uniform_sampler``: ``UniformWithReplacementSampler``, the Poisson
batch sampler, on dptrain's ``PoissonBatchSampler``."""

from __future__ import annotations

import torch

from dptrain.checks import check_sample_rate
from dptrain.data.sampling import PoissonBatchSampler
from dptrain.opacus._absent import absent


class UniformWithReplacementSampler(PoissonBatchSampler):
    """Opacus's Poisson batch sampler: `steps` batches (default int(1 / sample_rate), Opacus's
    count), each the indices of range(num_samples) kept independently with probability
    `sample_rate`. Without `generator` the coins come from OS entropy (dptrain's default), not
    torch's global RNG.
    """

    def __init__(self, *, num_samples: int, sample_rate: float,
                 generator: torch.Generator | None = None, steps: int | None = None) -> None:
        sample_rate = check_sample_rate(sample_rate, "sample_rate")
        super().__init__(num_samples, sample_rate, generator=generator,
                         steps=int(1 / sample_rate) if steps is None else steps)


DistributedUniformWithReplacementSampler = absent(
    "opacus.utils.uniform_sampler.DistributedUniformWithReplacementSampler",
    "dptrain.opacus.data_loader.DPDataLoader.from_data_loader(loader, distributed=True) (each "
    "rank Poisson-samples its own shard: dptrain.data.distributed), or make_private on a "
    "DistributedDataParallel model, which builds it")

__all__ = ["DistributedUniformWithReplacementSampler", "UniformWithReplacementSampler"]
