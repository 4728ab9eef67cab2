"""User-level privacy where it crosses other features (issue 41, holes 1 and 2).

Crossings covered; each test is named after the property it guards ("before": the code before
these fixes):

| crossing                                  | test (here unless a path is given)                 |
|-------------------------------------------|----------------------------------------------------|
| unit=user x resume, make_private user_ids | ..._two_examples_moved_is_charged_anew_not_replayed |
|   (before: an exact replay, charged once) |                                                    |
| unit=user x resume, CLI user_column       | tests/cli/test_cli_user_level.py::test_a_cli_resume |
|                                           |   _after_two_rows_changed_user_is_charged_anew_... |
| unit=user x resume, users renamed         | ..._same_users_renamed_is_still_exact              |
| unit=user x a ledger older than the field | ..._older_user_level_ledger_without_user_finger... |
| unit=example x resume (no regression)     | ..._example_level_ledger_records_no_users_...      |
| the users' fingerprint itself             | ..._user_fingerprint_changes_with_a_moved_example_ |
| unit=user x a collate that sorts rows     | ..._clipped_sum_by_at_most_C_with_a_sorting_collate |
|   (before: 2.0 C and 2.8 C)               |                                                    |
| unit=user x SortingCollate                | ..._sorting_collates_clipped_sum_equals_the_micro_ |
| ... x BatchMemoryManager chunks           | ..._cut_across_physical_chunks_out_of_order_...    |
| ... x ghost clipping (both tests above)   |   parametrized over hooks and ghost                |
| ... x DataLoader worker processes         | ..._row_order_crosses_worker_processes             |
| ... x pack_padded_sequence + DPLSTM       | test_packed_sequences_sorted_by_length_...         |
| unit=user x keeps_row_order(fn)           | ..._declared_with_keeps_row_order_is_exact         |
| unit=user x an undeclared custom collate  | ..._undeclared_custom_collate_is_refused_...       |
| unit=user x a reported non-permutation    | ..._not_a_permutation_is_refused                   |
| unit=example x SortingCollate             | ..._example_level_loader_hands_out_the_sorted_...  |
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, TensorDataset, default_collate

import dptrain
from dptrain.data.fingerprint import user_assignment_fingerprint
from dptrain.data.row_order import RowOrderedBatch, SortingCollate, keeps_row_order
from dptrain.data.user_sampling import user_groups
from dptrain.errors import PrivacyError
from dptrain.layers import DPLSTM
from dptrain.train.ledger import epsilon_of, history_from_json, load_ledger
from dptrain.train.loop import train
from tests.privacy.privacy_helpers import clipped_sum, per_sample_grads, tiny_model
from tests.train.test_trainer_support import N_TRAIN, make_job, make_settings

pytestmark = pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")

# -- hole 1: a resume over re-assigned users --------------------------------------------------
USERS = [i // 3 for i in range(N_TRAIN)]   # 16 users of 3 examples
BATCH_USERS = 4                              # q = 4 / 16: 4 steps an epoch
STEPS_PER_EPOCH = 4


def _moved(user_ids: list[int]) -> list[int]:
    """`user_ids` with two examples moved to other users (same data, same 16 users)."""
    moved = list(user_ids)
    moved[0], moved[5] = 5, 0    # example 0 (user 0) to user 5, example 5 (user 1) to user 0
    assert len(set(moved)) == len(set(user_ids))
    return moved


def _user_job(user_ids: list, **kwargs):
    return make_job(batch_size=BATCH_USERS, engine_kwargs={"privacy_unit": "user",
                                                           "user_ids": user_ids}, **kwargs)


def _user_settings(run_dir: Path, **kwargs):
    return make_settings(run_dir, epochs=3, batch_size=BATCH_USERS, **kwargs)


def _resume_from_epoch_1(run_dir: Path, user_ids: list):
    return train(_user_job(user_ids), _user_settings(
        run_dir, resume=str(run_dir / "checkpoints" / "epoch_1.pt")))


def test_a_resume_over_users_with_two_examples_moved_is_charged_anew_not_replayed(
        tmp_path: Path) -> None:
    first = train(_user_job(USERS), _user_settings(tmp_path))
    again = _resume_from_epoch_1(tmp_path, _moved(USERS))
    ledger = load_ledger(tmp_path)
    every_step = [(1.0, BATCH_USERS / 16, 5 * STEPS_PER_EPOCH)]   # epochs 2 and 3 twice
    assert history_from_json(ledger["history"]) == every_step
    assert ledger["resumes"][-1]["charged_steps"] == 2 * STEPS_PER_EPOCH
    assert again.epsilon == ledger["epsilon"] == epsilon_of(every_step, 1e-5, "rdp")
    assert again.epsilon > first.epsilon
    assert ledger["dataset"]["user_fingerprints"] == [
        user_assignment_fingerprint(user_groups(ids, N_TRAIN), None)
        for ids in (USERS, _moved(USERS))]
    assert len(set(ledger["dataset"]["fingerprints"])) == 1   # the records themselves are the same


def test_a_resume_over_the_same_users_renamed_is_still_exact(tmp_path: Path) -> None:
    first = train(_user_job(USERS), _user_settings(tmp_path))
    renamed = [f"user-{u}" for u in USERS]      # the same groups: the same computation
    again = _resume_from_epoch_1(tmp_path, renamed)
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, BATCH_USERS / 16, 3 * STEPS_PER_EPOCH)]
    assert again.epsilon == first.epsilon and ledger["resumes"][-1]["charged_steps"] == 0
    assert len(ledger["dataset"]["user_fingerprints"]) == 1


def test_an_older_user_level_ledger_without_user_fingerprints_resumes_charged_anew(
        tmp_path: Path) -> None:
    train(_user_job(USERS), _user_settings(tmp_path))
    ledger_file = tmp_path / "privacy_ledger.json"
    ledger = json.loads(ledger_file.read_text())
    del ledger["dataset"]["user_fingerprints"]          # as a dptrain before the field wrote it
    ledger_file.write_text(json.dumps(ledger))
    load_ledger(tmp_path)                                # still verifies
    _resume_from_epoch_1(tmp_path, USERS)
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, BATCH_USERS / 16, 5 * STEPS_PER_EPOCH)]
    assert ledger["dataset"]["user_fingerprints"][0] == "unknown"


def test_an_example_level_ledger_records_no_users_and_still_replays_exactly(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    assert "user_fingerprints" not in load_ledger(tmp_path)["dataset"]
    train(make_job(), make_settings(tmp_path, epochs=3,
                                    resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    assert load_ledger(tmp_path)["resumes"][-1]["charged_steps"] == 0


def test_the_user_fingerprint_changes_with_a_moved_example_the_user_order_and_the_cap() -> None:
    def fingerprint(ids: list, cap: int | None = None) -> str:
        return user_assignment_fingerprint(user_groups(ids, len(ids)), cap)

    base = fingerprint(USERS)
    assert fingerprint([f"u{u}" for u in USERS]) == base        # renamed: same groups
    assert fingerprint(_moved(USERS)) != base                   # two examples moved
    groups = user_groups(USERS, len(USERS))
    assert user_assignment_fingerprint(groups[::-1], None) != base   # the users' order
    assert fingerprint(USERS, cap=2) != base                    # max_examples_per_user


# -- hole 2: a collate function that reorders rows --------------------------------------------
def _by_first_feature(item) -> float:
    return float(item[0][0])


class _SortsAndSaysSo:
    """A collate that sorts its items by the first feature (as a length sort for packed
    sequences would) and reports the order through the protocol (a plain (batch, order) pair,
    no dptrain name needed): called as a function it returns the sorted batch."""

    def collate_with_order(self, items):
        order = sorted(range(len(items)), key=lambda i: _by_first_feature(items[i]), reverse=True)
        return default_collate([items[i] for i in order]), order

    def __call__(self, items):
        return self.collate_with_order(items)[0]


def _data(user_ids: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = len(user_ids)
    return (torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3,
            torch.randint(0, 2, (n,), generator=gen))


def _one_step_sum(x, y, user_ids, C, collate, chunk=None, workers=0,
                  mode: str = "hooks") -> list[torch.Tensor]:
    """The noise-free clipped sum of one user-level step at q = 1 (every user), per parameter
    in model order (the model: `tiny_model()`)."""
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(set(user_ids)),
                               collate_fn=collate, num_workers=workers),
        noise_multiplier=0.0, max_grad_norm=C, privacy_unit="user", user_ids=user_ids,
        grad_sample_mode=mode)
    captured = []
    optimizer.attach_step_hook(lambda opt: captured.extend(p.summed_grad.clone()
                                                           for p in opt.params))
    batches = loader
    if chunk is not None:
        manager = dptrain.BatchMemoryManager(data_loader=loader, optimizer=optimizer,
                                             max_physical_batch_size=chunk)
        batches = manager.__enter__()
    for xb, yb in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(xb), yb).backward()
        optimizer.step()
        if captured:
            return captured
    raise AssertionError("no step was taken")


def _user_mean_clipped_sum(x, y, user_ids, C) -> list[torch.Tensor]:
    """Ground truth (float64): each user's mean of its examples' micro-batch gradients, clipped
    to C, summed."""
    model = tiny_model()
    grads = per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    users = sorted(set(user_ids), key=user_ids.index)
    means = {p: torch.stack([g[[i for i, u in enumerate(user_ids) if u == user]].mean(0)
                             for user in users]) for p, g in grads.items()}
    summed = clipped_sum(means, C)
    return [summed[p] for p in model.parameters()]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum((u - v).pow(2).sum().item() for u, v in zip(a, b)))


BIG_USER = [0] * 5 + list(range(1, 16))   # one user with 5 examples, 15 with one
C = 0.05


@pytest.mark.parametrize("seed", [0, 3])
def test_removing_a_user_moves_the_clipped_sum_by_at_most_C_with_a_sorting_collate(
        seed: int) -> None:
    x, y = _data(BIG_USER, seed)
    others = [i for i, u in enumerate(BIG_USER) if u != 0]
    with_user = _one_step_sum(x, y, BIG_USER, C, _SortsAndSaysSo())
    without = _one_step_sum(x[others], y[others], [BIG_USER[i] for i in others], C,
                            _SortsAndSaysSo())
    assert C * 0.5 < _distance(with_user, without) <= C * (1 + 1e-12)   # 2.0 and 2.8 C before


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_sorting_collates_clipped_sum_equals_the_micro_batch_ground_truth(mode: str) -> None:
    user_ids = [7, 7, 3, 9, 9, 9, 3, 5, 7, 7, 7, 1]
    x, y = _data(user_ids, seed=1)
    summed = _one_step_sum(x, y, user_ids, 0.3, SortingCollate(_by_first_feature), mode=mode)
    for got, expected in zip(summed, _user_mean_clipped_sum(x, y, user_ids, 0.3)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_users_cut_across_physical_chunks_out_of_order_are_each_clipped_once_as_a_whole(
        chunk: int, mode: str) -> None:
    """Ghost mode too: several users carried at once, their rows of later chunks added."""
    user_ids = [0] * 5 + [1] * 3 + [2] * 4 + [3]
    x, y = _data(user_ids, seed=2)
    summed = _one_step_sum(x, y, user_ids, 0.3, SortingCollate(_by_first_feature), chunk=chunk,
                           mode=mode)
    for got, expected in zip(summed, _user_mean_clipped_sum(x, y, user_ids, 0.3)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_the_row_order_crosses_worker_processes() -> None:
    user_ids = [7, 7, 3, 9, 9, 9, 3, 5, 7, 7, 7, 1]
    x, y = _data(user_ids, seed=1)
    summed = _one_step_sum(x, y, user_ids, 0.3, SortingCollate(_by_first_feature), workers=1)
    for got, expected in zip(summed, _user_mean_clipped_sum(x, y, user_ids, 0.3)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_an_order_keeping_collate_declared_with_keeps_row_order_is_exact() -> None:
    user_ids = [7, 7, 3, 9, 9, 9, 3, 5, 7, 7, 7, 1]
    x, y = _data(user_ids, seed=1)
    summed = _one_step_sum(x, y, user_ids, 0.3,
                           keeps_row_order(lambda items: default_collate(items)))
    for got, expected in zip(summed, _user_mean_clipped_sum(x, y, user_ids, 0.3)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_an_undeclared_custom_collate_is_refused_naming_the_fix() -> None:
    x, y = _data(BIG_USER, seed=0)

    def sort_rows(items):
        return default_collate(sorted(items, key=_by_first_feature, reverse=True))

    with pytest.raises(PrivacyError,
                       match=r"collate_fn=.*sort_rows.*keeps_row_order.*SortingCollate"):
        _one_step_sum(x, y, BIG_USER, C, sort_rows)


def test_a_reported_order_that_is_not_a_permutation_is_refused() -> None:
    class Drops:
        def collate_with_order(self, items):
            return default_collate(items[1:]), list(range(1, len(items)))

        def __call__(self, items):
            return self.collate_with_order(items)[0]

    x, y = _data(BIG_USER, seed=0)
    with pytest.raises(PrivacyError, match="not a permutation"):
        _one_step_sum(x, y, BIG_USER, C, Drops())


def test_an_example_level_loader_hands_out_the_sorted_batch_not_a_row_ordered_pair() -> None:
    x, y = _data(list(range(6)), seed=0)
    model = tiny_model()
    _, _, loader, _ = dptrain.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=6,
                               collate_fn=SortingCollate(_by_first_feature)),
        noise_multiplier=1.0, max_grad_norm=1.0)
    xb, _ = next(iter(loader))
    assert not isinstance(xb, RowOrderedBatch) and len(xb) == 6
    assert torch.equal(xb[:, 0], xb[:, 0].sort(descending=True).values)


# -- pack_padded_sequence(enforce_sorted=True): the real use of a sorting collate ---------------
class _PackedLSTM(nn.Module):
    """A DPLSTM over packed, length-sorted sequences ([B, T, 3] padded + lengths [B])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = DPLSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=True)
        _, (hidden, _) = self.lstm(packed)
        return self.head(hidden[-1])


def _pad(items):
    """Order-keeping: padded sequences [B, T, 3], their lengths [B], labels [B]."""
    return (pad_sequence([s for s, _ in items], batch_first=True),
            torch.tensor([len(s) for s, _ in items]), torch.tensor([label for _, label in items]))


def test_packed_sequences_sorted_by_length_give_each_users_clipped_mean_exactly() -> None:
    user_ids = [0, 1, 0, 2, 0, 3, 4, 0, 5, 0, 6, 6]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (len(user_ids),), generator=gen)
    data = [(torch.randn(int(n), 3, generator=gen, dtype=torch.float64), int(label))
            for n, label in zip(lengths, torch.randint(0, 2, (len(user_ids),), generator=gen))]
    model = _PackedLSTM().double()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=7, collate_fn=SortingCollate(
            lambda item: len(item[0]), _pad)),
        noise_multiplier=0.0, max_grad_norm=0.1, privacy_unit="user", user_ids=user_ids)
    captured = {}
    optimizer.attach_step_hook(lambda opt: captured.update(
        {name: p.summed_grad.clone() for name, p in model.named_parameters()}))
    for x, n, label in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x, n), label).backward()   # sorted: enforce_sorted
        optimizer.step()
        break
    fresh = _PackedLSTM().double()
    fresh.load_state_dict(reference)
    params = dict(fresh.named_parameters())
    per_example = [torch.autograd.grad(nn.functional.cross_entropy(
        fresh(seq[None], torch.tensor([len(seq)])), torch.tensor([label]), reduction="sum"),
        list(params.values())) for seq, label in data]
    users = sorted(set(user_ids), key=user_ids.index)
    all_means = {p: torch.stack([torch.stack([per_example[i][k] for i, u in enumerate(user_ids)
                                              if u == user]).mean(0) for user in users])
                 for k, p in enumerate(params.values())}
    expected = clipped_sum(all_means, 0.1)
    for name, p in params.items():
        torch.testing.assert_close(captured[name], expected[p], rtol=1e-10, atol=1e-12)
