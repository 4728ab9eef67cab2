"""dptrain.opacus.utils.uniform_sampler: Opacus's UniformWithReplacementSampler (Poisson batches
of indices) with Opacus's signature and batch count."""

from __future__ import annotations

import pytest
import torch

from dptrain.errors import PrivacyError
from dptrain.opacus.utils.uniform_sampler import UniformWithReplacementSampler

opacus_sampler = pytest.importorskip("opacus.utils.uniform_sampler")


@pytest.mark.parametrize("sample_rate", [0.3, 0.25, 0.07])
def test_uniform_sampler_yields_as_many_batches_as_opacus(sample_rate):
    ours = UniformWithReplacementSampler(num_samples=100, sample_rate=sample_rate)
    theirs = opacus_sampler.UniformWithReplacementSampler(num_samples=100, sample_rate=sample_rate)
    assert len(ours) == len(list(ours)) == len(theirs) == int(1 / sample_rate)


def test_uniform_sampler_keeps_each_index_with_probability_sample_rate():
    sampler = UniformWithReplacementSampler(num_samples=1000, sample_rate=0.2, steps=50,
                                            generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert len(batches) == 50
    assert all(b == sorted(set(b)) and all(0 <= i < 1000 for i in b) for b in batches)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(200, abs=4 * (1000 * 0.2 * 0.8 / 50) ** 0.5)


def test_uniform_sampler_repeats_its_batches_from_a_seeded_generator():
    def batches():
        return list(UniformWithReplacementSampler(
            num_samples=50, sample_rate=0.1, generator=torch.Generator().manual_seed(3)))

    assert batches() == batches()


@pytest.mark.parametrize("sample_rate", [0.0, 1.5])
def test_uniform_sampler_refuses_a_sample_rate_outside_0_1(sample_rate):
    with pytest.raises(PrivacyError, match="sample_rate"):
        UniformWithReplacementSampler(num_samples=10, sample_rate=sample_rate)
