"""BatchMemoryManager: logical batches as physical chunks, skipping all but the last step; with
the real per-sample module, chunks give the same step as one batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.data.virtual import BatchMemoryManager, split_batch
from dptrain.errors import ConfigError
from tests.privacy.privacy_helpers import tiny_model


class RecordingOptimizer:
    """Records the skip signal in force at each step()."""

    def __init__(self) -> None:
        self.skip = False
        self.steps: list[bool] = []

    def signal_skip_step(self, do_skip: bool = True) -> None:
        self.skip = do_skip

    def step(self) -> None:
        self.steps.append(self.skip)
        self.skip = False


def _run(batches, max_size):
    opt = RecordingOptimizer()
    chunks = []
    with BatchMemoryManager(data_loader=batches, max_physical_batch_size=max_size,
                            optimizer=opt) as loader:
        for chunk in loader:
            chunks.append(chunk)
            opt.step()
    return chunks, opt


def test_chunks_are_at_most_the_physical_size_and_cover_the_logical_batch():
    x = torch.arange(10.0)
    chunks, _ = _run([(x, x * 2)], 4)
    assert [c[0].shape[0] for c in chunks] == [4, 4, 2]
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)
    assert torch.equal(torch.cat([c[1] for c in chunks]), x * 2)


def test_only_the_last_chunk_of_each_logical_batch_steps():
    _, opt = _run([torch.zeros(5, 1), torch.zeros(2, 1)], 2)
    assert opt.steps == [True, True, False, False]


def test_an_empty_logical_batch_is_one_empty_chunk_that_steps():
    chunks, opt = _run([torch.zeros(0, 3)], 2)
    assert len(chunks) == 1 and chunks[0].shape == (0, 3)
    assert opt.steps == [False]


def test_dict_batches_are_split_key_by_key():
    chunks = split_batch({"x": torch.zeros(5, 2), "y": torch.ones(5)}, 3)
    assert [c["x"].shape[0] for c in chunks] == [3, 2]
    assert [c["y"].shape[0] for c in chunks] == [3, 2]


def test_leaving_the_context_clears_a_pending_skip():
    opt = RecordingOptimizer()
    with BatchMemoryManager(data_loader=[torch.zeros(4, 1)], max_physical_batch_size=1,
                            optimizer=opt) as loader:
        next(iter(loader))
    assert opt.skip is False


def test_a_non_positive_physical_size_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=[], max_physical_batch_size=0, optimizer=RecordingOptimizer())


def test_an_optimizer_that_cannot_skip_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer"):
        BatchMemoryManager(data_loader=[], max_physical_batch_size=2, optimizer=object())


# -- with the real per-sample module and engine ---------------------------------------------
N = 48


def _train(max_physical_batch_size: int | None, sigma: float = 0.0, seed: int = 3):
    """One epoch of the user's plain loop, directly or through BatchMemoryManager."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, generator=gen, dtype=torch.float64) * 3,
                         torch.randint(0, 2, (N,), generator=gen))
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=seed, reproducible_mechanism=True)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DataLoader(data, batch_size=12), noise_multiplier=sigma, max_grad_norm=0.5)
    if max_physical_batch_size is None:
        batches = loader
        _loop(model, optimizer, batches)
    else:
        with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                        max_physical_batch_size=max_physical_batch_size) as batches:
            _loop(model, optimizer, batches)
    return [p.detach().clone() for p in model.parameters()], engine


def _loop(model, optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_with_noise_zero_physical_chunks_give_the_same_result_as_the_logical_batch():
    whole, _ = _train(None)
    chunked, _ = _train(max_physical_batch_size=5)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_with_noise_chunks_step_the_accountant_once_per_logical_batch():
    _, whole = _train(None, sigma=1.0)
    _, chunked = _train(max_physical_batch_size=2, sigma=1.0)
    assert len(chunked.accountant) == len(whole.accountant) == N // 12


def test_with_noise_and_the_same_seed_chunking_does_not_change_the_noise():
    whole, _ = _train(None, sigma=1.0)
    chunked, _ = _train(max_physical_batch_size=4, sigma=1.0)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_leaving_the_manager_mid_batch_discards_the_unreleased_chunks():
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, generator=gen, dtype=torch.float64),
                         torch.randint(0, 2, (N,), generator=gen))
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=N), noise_multiplier=1.0, max_grad_norm=0.5)
    loader.poisson_sampler.sample_rate_schedule = lambda step: 1.0  # every example, 48 rows
    with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                    max_physical_batch_size=8) as batches:
        x, y = next(iter(batches))
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()  # a skipped step: accumulates 8 clipped samples
        assert all(p.summed_grad is not None for p in model.parameters())
    assert all(p.summed_grad is None for p in model.parameters())
    assert len(engine.accountant) == 0


def test_an_empty_logical_batch_through_the_manager_is_one_noisy_accounted_step():
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, generator=gen, dtype=torch.float64),
                         torch.randint(0, 2, (N,), generator=gen))
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=12), noise_multiplier=1.0, max_grad_norm=0.5,
        sample_rate_schedule=lambda step: 1e-12)  # every logical batch is empty
    before = [p.detach().clone() for p in model.parameters()]
    with dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                    max_physical_batch_size=4) as batches:
        _loop(model, optimizer, batches)
    assert len(engine.accountant) == len(loader) == N // 12
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters()))
