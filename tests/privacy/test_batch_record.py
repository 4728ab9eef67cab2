"""One batch record from sampler to accountant (dptrain.data.batch_record, dptrain.privacy.charge).

The sampler draws a `BatchRecord` per batch (its index, the q it was drawn with, this rank's rows,
the user position of each row at user level); the loader publishes it when the batch reaches the
loop; `DPOptimizer.release(record)` takes q from it and returns the step's `Charge`; the
accountant is stepped with charges only, so it can be rebuilt from them.

Crossings that can change what is charged or released, and where each is tested:

| crossing                                   | test                                                   |
|--------------------------------------------|--------------------------------------------------------|
| sample-rate schedule, skipped Poisson batch | test_a_skipped_batch_is_charged_at_the_q_of_the_record_released |
| the caller's collate (rows reordered)       | test_a_reordering_collate_reorders_the_records_rows_and_users |
| user level                                  | test_user_level_records_carry_the_user_of_each_row     |
| BatchMemoryManager (physical chunks)        | test_virtual_batches_charge_one_record_per_logical_batch |
| the caller's loader kept as passes          | test_a_kept_loaders_records_count_its_batches           |
| ranks (a rank's share)                      | test_a_ranks_record_holds_its_share_of_the_batch        |
| the training loop (private_step), resume   | test_a_training_runs_ledger_history_is_its_charges      |
| the Opacus namespace                        | test_the_opacus_namespace_charges_the_records_q         |
| the Hugging Face Trainer                    | tests/integrations/test_hf_trainer.py (its step releases the record) |
"""

from __future__ import annotations

import pytest
import torch
from privacy_helpers import loop_step, tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import get_accountant
from dptrain.data.batch_record import BatchRecord, last_record
from dptrain.data.row_order import SortingCollate
from dptrain.data.sampling import DPDataLoader
from dptrain.data.sharding import RankShare
from dptrain.data.user_sampling import UserDPDataLoader
from dptrain.errors import PrivacyError
from dptrain.privacy.schedules import StepSchedule
from dptrain.privacy.step import private_step

N = 48


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    return TensorDataset(x, torch.arange(N) % 2)


def _private(data_loader: DataLoader | None = None, **kwargs):
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data_loader or DataLoader(_dataset(), batch_size=6),
        noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)
    charges = []
    optimizer.add_charge_listener(charges.append)
    return engine, model, optimizer, loader, charges


def test_a_records_rows_are_the_rows_of_its_batch():
    data = _dataset()
    loader = DPDataLoader(data, 0.25, generator=torch.Generator().manual_seed(1))
    for index, (x, _) in enumerate(loader):
        record = loader.last_record()
        assert record.index == index and record.sample_rate == 0.25
        assert torch.equal(x, data.tensors[0][list(record.indices)])


def test_each_step_charges_the_record_of_the_batch_it_released():
    engine, model, optimizer, loader, charges = _private(
        sample_rate_schedule=StepSchedule(0.125, gamma=0.5, step_size=2))
    records = []
    for batch in loader:
        records.append(last_record(loader))
        loop_step(model, optimizer, batch)
    assert [(c.batch_index, c.sample_rate, c.step) for c in charges] == [
        (r.index, r.sample_rate, i) for i, r in enumerate(records)]
    assert [c.batch_size for c in charges] == [r.size for r in records]


def test_the_accountant_holds_exactly_the_steps_charged():
    engine, model, optimizer, loader, charges = _private()
    for batch in loader:
        loop_step(model, optimizer, batch)
    rebuilt = get_accountant("rdp").from_charges(charges)
    assert rebuilt.history == engine.accountant.history
    assert rebuilt.get_epsilon(1e-5) == engine.accountant.get_epsilon(1e-5)


def test_a_skipped_batch_is_charged_at_the_q_of_the_record_released():
    """Batch 1 is drawn under a schedule and never stepped on: step 1 releases batch 2 and is
    charged q(2), the q the batch was drawn with (not the schedule's q at step 1)."""
    schedule = StepSchedule(0.25, gamma=0.5, step_size=1)
    engine, model, optimizer, loader, charges = _private(sample_rate_schedule=schedule)
    batches = iter(loader)
    loop_step(model, optimizer, next(batches))
    next(batches)                                   # drawn, never stepped on
    loop_step(model, optimizer, next(batches))
    assert [(c.step, c.batch_index, c.sample_rate) for c in charges] == [
        (0, 0, schedule(0)), (1, 2, schedule(2))]


def test_a_stale_record_given_to_private_step_releases_nothing():
    engine, model, optimizer, loader, charges = _private()
    batches = iter(loader)
    next(batches)
    stale = last_record(loader)
    batch = next(batches)
    with pytest.raises(PrivacyError, match="handed out last"):
        private_step(optimizer, batch, None,
                     lambda b: _forward_backward(model, b), stale)
    assert charges == [] and engine.accountant.history == []


def _forward_backward(model, batch) -> int:
    x, y = batch
    if len(x):
        nn.functional.cross_entropy(model(x), y).backward()
    return len(x)


def test_virtual_batches_charge_one_record_per_logical_batch():
    engine, model, optimizer, loader, charges = _private(
        sample_rate_schedule=StepSchedule(0.25, gamma=0.5, step_size=1))
    records = []
    with dptrain.BatchMemoryManager(data_loader=loader, max_physical_batch_size=2,
                                    optimizer=optimizer) as chunks:
        for chunk in chunks:
            record = last_record(loader)
            if not records or records[-1] is not record:
                records.append(record)
            loop_step(model, optimizer, chunk)
    assert [(c.batch_index, c.sample_rate) for c in charges] == [
        (r.index, r.sample_rate) for r in records]


def test_a_ranks_record_holds_its_share_of_the_batch():
    whole = DPDataLoader(_dataset(), 0.5, generator=torch.Generator().manual_seed(3))
    share = DPDataLoader(_dataset(), 0.5, generator=torch.Generator().manual_seed(3))
    share.poisson_sampler.rank_share = RankShare(1, 3)
    for _ in zip(whole, share):
        full, own = whole.last_record(), share.last_record()
        assert own.indices == tuple(i for i in full.indices if i % 3 == 1)
        assert own.index == full.index and own.sample_rate == full.sample_rate


def _user_loader(collate=None) -> UserDPDataLoader:
    users = [i // 3 for i in range(N)]                  # 16 users of 3 examples
    plain = DataLoader(_dataset(), batch_size=4, collate_fn=collate)
    return UserDPDataLoader.from_user_ids(plain, users, generator=torch.Generator().manual_seed(2))


def test_user_level_records_carry_the_user_of_each_row():
    loader = _user_loader()
    for _ in loader:
        record = loader.last_record()
        users = [i // 3 for i in record.indices]
        positions = {u: k for k, u in enumerate(dict.fromkeys(users))}
        assert record.user_groups.tolist() == [positions[u] for u in users]
        assert loader.batch_user_groups() is record.user_groups


def test_a_reordering_collate_reorders_the_records_rows_and_users():
    """A collate that sorts the rows (by their first feature) reports the order; the record's
    rows and user positions follow the collated rows."""
    data = _dataset().tensors[0]
    plain = _user_loader()
    sorting = _user_loader(SortingCollate(key=lambda item: float(item[0][0])))
    for _, (rx, _) in zip(plain, sorting):
        drawn, record = plain.last_record(), sorting.last_record()
        assert sorted(record.indices) == sorted(drawn.indices) and record.indices != drawn.indices
        assert torch.equal(rx, data[list(record.indices)])
        position = {i: int(g) for i, g in zip(drawn.indices, drawn.user_groups)}
        assert record.user_groups.tolist() == [position[i] for i in record.indices]


def test_a_kept_loaders_records_count_its_batches():
    engine, model, optimizer, loader, charges = _private(sampling="given_shuffle")
    for epoch in range(2):
        for batch in loader:
            loop_step(model, optimizer, batch)
    q = engine.plan.selection.sample_rate
    assert [(c.batch_index, c.sample_rate) for c in charges] == [(i, q) for i in range(16)]
    assert all(c.batch_size is None for c in charges)   # the caller's sampler chose the rows


def test_the_opacus_namespace_charges_the_records_q():
    from dptrain.opacus import PrivacyEngine as OpacusEngine
    model = tiny_model()
    engine = OpacusEngine(accountant="rdp")
    with pytest.warns(UserWarning):
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_dataset(), batch_size=6), noise_multiplier=1.0,
            max_grad_norm=1.0, noise_generator=None)
    charges = []
    optimizer.add_charge_listener(charges.append)
    records = []
    for batch in loader:
        records.append(last_record(loader))
        loop_step(model, optimizer, batch)
    assert [(c.batch_index, c.sample_rate) for c in charges] == [
        (r.index, r.sample_rate) for r in records]
    assert engine.accountant.history == [(1.0, 0.125, len(records))]


def test_a_record_compares_by_its_draw_not_its_user_tensor():
    a = BatchRecord(index=1, sample_rate=0.5, indices=(2, 3), user_groups=torch.tensor([0, 1]))
    b = BatchRecord(index=1, sample_rate=0.5, indices=(2, 3), user_groups=torch.tensor([0, 1]))
    assert a == b and a.size == 2


def test_a_training_runs_ledger_history_is_its_charges(tmp_path):
    """The loop (private_step with the loader's record) charges each step once; the ledger's
    history, the engine's accountant and an accountant rebuilt from the charges are one record;
    a resumed run's charges continue the steps, with the batch indices the sampler drew."""
    import json

    from dptrain.train import TrainSettings, private_job, train

    schedule = StepSchedule(0.125, gamma=0.5, step_size=4)   # one object: the config's repr

    def run(resume: str | None, max_steps: int):
        engine, model, optimizer, loader, charges = _private(sample_rate_schedule=schedule)
        job = private_job(engine, model, optimizer, loader, dataset_name="tiny")
        train(job, TrainSettings(run_dir=tmp_path, epochs=2, batch_size=6, max_steps=max_steps,
                                 progress=False, resume=resume, checkpoint_every=1))
        return engine, charges

    engine, charges = run(None, 8)                   # one epoch of 8 steps, checkpointed
    assert [c.step for c in charges] == [c.batch_index for c in charges] == list(range(8))
    engine, resumed = run("auto", 12)
    assert [c.step for c in resumed] == list(range(8, 12))
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    history = [(r["noise_multiplier"], r["sample_rate"], r["steps"]) for r in ledger["history"]]
    rebuilt = get_accountant("rdp").from_charges(charges + resumed)
    assert rebuilt.history == engine.accountant.history == history


def test_the_charge_private_step_returns_is_the_one_the_accountant_received():
    """Also when the record does not know the rows (the caller's loader kept as passes): the
    rows the step trained on are in the charge its listeners receive."""
    engine, model, optimizer, loader, charges = _private(sampling="given_shuffle")
    batch = next(iter(loader))
    returned = private_step(optimizer, batch, 2, lambda b: _forward_backward(model, b),
                            last_record(loader))
    assert charges == [returned] and optimizer.last_charge == returned
    assert returned.batch_size == len(batch[0])
