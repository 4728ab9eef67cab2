"""Balls-in-bins batches (dptrain/privacy/selection/balls_in_bins.py): the index stream, its
neighbouring relation, the plan and the engine's accounting.

Crossings that can change what is charged or released, and where each is tested:

| crossing                         | test                                                        |
|----------------------------------|-------------------------------------------------------------|
| resume (sampler state, epochs)   | here (sampler state); tests/cli/test_cli_balls_in_bins.py    |
| replay fingerprint / ledger      | tests/cli/test_cli_balls_in_bins.py (ledger verified)        |
| caller's collate and sampler     | here (collate kept; a caller's sampler is replaced)         |
| user level                       | here (refused: users are Poisson-sampled)                   |
| DDP / FSDP                       | here (rank shares of one allocation); CLI under torchrun    |
| correlated noise, adaptive clip  | here (refused naming the keys)                              |
| 16-bit, sweeps and tuning        | unchanged: the selection only draws indices; the planner    |
|                                  | and calibration read the plan's AccountingEvent (here)      |
| Opacus namespace                 | poisson_sampling=False keeps the caller's loader (given_shuffle / shuffle): not mapped to balls-in-bins (it would change the caller's batches) |
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import random_allocation
from dptrain.accounting.calibration import get_noise_multiplier
from dptrain.data.sharding import shard_sampler
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.plan import Clipping, Noise, PrivacyPlan, Selection, Unit
from dptrain.privacy.selection import BallsInBins
from dptrain.privacy.selection.balls_in_bins import BallsInBinsBatchSampler, BallsInBinsDataLoader


def _sampler(n: int = 50, q: float = 0.1, seed: int | None = 0) -> BallsInBinsBatchSampler:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return BallsInBinsBatchSampler(n, q, generator=gen)


def _epoch(sampler: BallsInBinsBatchSampler) -> list[list[int]]:
    batches = []
    for batch in sampler:
        sampler.hand_out()
        batches.append(batch)
    return batches


# -- the index stream --------------------------------------------------------------------------
def test_every_example_is_in_exactly_one_batch_of_each_epoch():
    sampler = _sampler()
    for _ in range(3):
        batches = _epoch(sampler)
        assert len(batches) == 10
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(50))


def test_epochs_draw_fresh_allocations():
    sampler = _sampler()
    assert _epoch(sampler) != _epoch(sampler)


def test_batch_sizes_are_binomial_with_the_public_expected_size():
    """Each batch size ~ Binomial(N, 1/k): mean N/k, variance N (1/k)(1 - 1/k)."""
    sizes = torch.tensor([len(b) for seed in range(200) for b in _epoch(_sampler(seed=seed))],
                         dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(5.0)
    assert sizes.var().item() == pytest.approx(50 * 0.1 * 0.9, rel=0.15)


def test_adding_an_example_moves_no_other_example_to_another_batch():
    """Add/remove: each example's batch is its own draw, so the allocation of the other N
    examples is the same with or without the added one (same generator state)."""
    without, with_one = _epoch(_sampler(n=50)), _epoch(_sampler(n=51))
    assert [[i for i in b if i < 50] for b in with_one] == without
    assert sum(50 in b for b in with_one) == 1


def test_a_mid_epoch_state_resumes_the_same_allocation():
    """Reproducible randomness saves the epoch's allocation: a sampler restored 3 batches into
    the epoch draws the remaining 7 batches of an uninterrupted epoch."""
    batches = _epoch(_sampler())
    stopped = _sampler()
    iterator = iter(stopped)
    first = []
    for _ in range(3):
        first.append(next(iterator))
        stopped.hand_out()
    resumed = _sampler(seed=123)                 # another generator: the state restores it
    resumed.load_state_dict(stopped.state_dict())
    rest = _epoch(resumed)[:7]
    assert first + rest == batches


def test_a_mid_epoch_state_without_its_allocation_is_refused():
    sampler = _sampler(seed=None)              # OS entropy: the allocation is never saved
    iterator = iter(sampler)
    next(iterator)
    sampler.hand_out()
    fresh = _sampler(seed=None)
    with pytest.raises(PrivacyError, match="stopped 1 batches into an epoch"):
        fresh.load_state_dict(sampler.state_dict())


def test_rank_shares_of_one_allocation_are_disjoint_and_make_up_the_whole_batch():
    whole = _epoch(_sampler())
    shares = []
    for rank in range(3):
        sampler = shard_sampler(_sampler(), rank=rank, world_size=3)
        shares.append(_epoch(sampler))
    for step, batch in enumerate(whole):
        parts = [shares[r][step] for r in range(3)]
        assert sorted(i for p in parts for i in p) == batch
        assert all(i % 3 == r for r, p in enumerate(parts) for i in p)


def test_secure_rank_shares_put_every_example_in_exactly_one_batch_of_each_epoch():
    """In secure mode each rank draws from its own CSPRNG and keeps its own examples: each
    example's batch is still one uniform draw, and every example is in one batch an epoch."""
    ranks = [shard_sampler(BallsInBinsBatchSampler(30, 0.2, secure=True), rank=r, world_size=3)
             for r in range(3)]
    for _ in range(2):
        shares = [_epoch(sampler) for sampler in ranks]
        assert all(len(s) == 5 for s in shares)
        assert sorted(i for s in shares for b in s for i in b) == list(range(30))


# -- the plan -----------------------------------------------------------------------------------
def test_the_plan_records_q_as_one_over_the_batches_per_epoch():
    selection = Selection(sample_rate=64 / 1000, kind="balls_in_bins")
    assert isinstance(selection, BallsInBins)
    assert selection.steps_per_epoch == 16 and selection.sample_rate == 1 / 16


def test_its_steps_are_charged_by_the_random_allocation_analysis_under_add_remove():
    selection = Selection(sample_rate=0.1, kind="balls_in_bins")
    assert selection.relation == "add/remove" and not selection.amplified
    accountant = dptrain.accounting.get_accountant("prv", selection.accounting)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, steps=30)
    assert accountant.get_epsilon(1e-4) == pytest.approx(
        random_allocation.epsilon(1.0, 10, 3, 1e-4), rel=1e-12)


def test_a_started_epoch_is_charged_as_a_whole_one():
    event = Selection(sample_rate=0.1, kind="balls_in_bins").accounting
    partial = dptrain.accounting.compute_epsilon([(1.0, 0.1, 21)], 1e-4, "prv", event)
    assert partial == pytest.approx(random_allocation.epsilon(1.0, 10, 3, 1e-4), rel=1e-12)


def test_calibration_meets_the_target_with_the_random_allocation_epsilon():
    event = Selection(sample_rate=0.1, kind="balls_in_bins").accounting
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-4, sample_rate=0.1,
                                 epochs=3, accountant="prv", sampling=event)
    spent = random_allocation.epsilon(sigma, 10, 3, 1e-4)
    assert 2.97 <= spent <= 3.0


@pytest.mark.parametrize("kwargs,key", [
    ({"unit": Unit("user")}, "privacy.unit=user"),
    ({"clipping": Clipping(1.0, kind="adaptive")}, "clipping=adaptive"),
])
def test_what_it_cannot_account_is_refused_naming_the_key(kwargs: dict, key: str):
    plan = dict(selection=Selection(0.1, kind="balls_in_bins"), clipping=Clipping(1.0),
                noise=Noise(multiplier=1.0))
    plan.update(kwargs)
    with pytest.raises(ConfigError, match=key):
        PrivacyPlan(**plan)


def test_correlated_noise_is_refused_naming_privacy_noise():
    from dptrain.privacy.noise import Banded

    with pytest.raises(ConfigError, match="privacy.noise=banded"):
        PrivacyPlan(selection=Selection(0.1, kind="balls_in_bins"), clipping=Clipping(1.0),
                    noise=Noise(multiplier=1.0, strategy=Banded((0.8, 0.6))))


# -- the engine -----------------------------------------------------------------------------------
def _data(n: int = 40) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen)
    return DataLoader(TensorDataset(x, torch.randint(0, 2, (n,), generator=gen)), batch_size=8)


def test_make_private_trains_each_example_once_an_epoch_and_charges_random_allocation():
    model = nn.Linear(3, 2)
    engine = dptrain.PrivacyEngine(accountant="prv", seed=0)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=_data(), noise_multiplier=1.0, max_grad_norm=1.0, sampling="balls_in_bins")
    assert isinstance(loader, BallsInBinsDataLoader)
    seen = []
    for x, y in loader:
        optimizer.zero_grad()
        seen.append(len(x))
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert sum(seen) == 40 and len(seen) == 5
    assert optimizer.expected_batch_size == pytest.approx(8.0)
    assert engine.get_epsilon(1e-5) == pytest.approx(
        random_allocation.epsilon(1.0, 5, 1, 1e-5), rel=1e-12)


def test_the_callers_collate_is_kept():
    calls = []

    def collate(rows):
        calls.append(len(rows))
        return torch.utils.data.default_collate(rows)

    loader = DataLoader(_data().dataset, batch_size=8, collate_fn=collate)
    model = nn.Linear(3, 2)
    _, _, private = dptrain.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, sampling="balls_in_bins")
    x = next(x for x, _ in private if len(x))   # an empty batch is collated from one row
    assert len(x) in calls
