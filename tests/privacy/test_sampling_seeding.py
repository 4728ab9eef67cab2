"""Which examples each Poisson batch holds cannot be rebuilt from public information unless
reproducibility is asked.

Amplification by subsampling (q < 1), which every accountant counts on, assumes that the members of
each batch are secret. The attack: rerun the same code with the same public seed (which also fixes
torch's global RNG) and read off the batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.data.sampling import DPDataLoader
from dptrain.privacy.engine import PrivateTraining

N, BATCH, STEPS, SEED = 40, 20, 4, 0


def _private(**engine_kwargs) -> PrivateTraining:
    """make_private with the public seed, over N examples whose value is their index."""
    torch.manual_seed(SEED)
    model = nn.Linear(1, 1)
    return dptrain.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH),
        noise_multiplier=1.0, max_grad_norm=1.0, accountant="rdp", seed=SEED, **engine_kwargs)


def _batches(**engine_kwargs) -> list[list[int]]:
    """The examples of the first STEPS Poisson batches of a fresh run with the public seed."""
    loader = _private(**engine_kwargs).data_loader
    return [batch.tolist() for (batch,), _ in zip(loader, range(STEPS))]


def test_the_batches_cannot_be_rebuilt_from_the_seed_by_default():
    assert _batches() != _batches()   # equal with probability 2^-160


def test_with_a_reproducible_mechanism_the_seed_rebuilds_the_batches():
    assert _batches(reproducible_mechanism=True) == _batches(reproducible_mechanism=True)


def test_a_poisson_loader_built_without_a_generator_does_not_draw_from_torchs_global_rng():
    draws = []
    for _ in range(2):
        torch.manual_seed(SEED)
        loader = DPDataLoader(TensorDataset(torch.arange(N)), sample_rate=0.5)
        draws.append([batch.tolist() for (batch,), _ in zip(loader, range(STEPS))])
    assert draws[0] != draws[1]


def test_the_engine_state_holds_the_sampling_generator_state_only_when_reproducible():
    samplers = {reproducible: _private(reproducible_mechanism=reproducible).engine.state_dict()
                ["sampler"] for reproducible in (False, True)}
    assert "generator" not in samplers[False] and "generator" in samplers[True]


def test_a_caller_seeded_noise_generator_is_reported_as_reproducible_randomness():
    noise = torch.Generator().manual_seed(SEED)
    engines = [_private().engine, _private(noise_generator=noise).engine]
    assert [engine.randomness() for engine in engines] == ["os_entropy", "reproducible"]
    assert not any(engine.mechanism_replays() for engine in engines)   # the batches are fresh


def test_the_removed_reproducible_noise_keyword_is_refused_never_ignored():
    with pytest.raises(TypeError, match="reproducible_noise"):
        dptrain.PrivacyEngine(accountant="rdp", seed=SEED, reproducible_noise=True)
