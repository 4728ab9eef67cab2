"""The caller's own DataLoader charged as shuffled batches: which loaders qualify, the q that
makes one pass an epoch, and the wrapper whose passes are the accountant's epochs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from dptrain.accounting.history import steps_per_epoch
from dptrain.data.given_shuffle import (
    GivenShuffleLoader,
    check_given_shuffle,
    given_shuffle_rate,
    problem,
)
from dptrain.errors import ConfigError

N = 10


def _dataset(n: int = N) -> TensorDataset:
    """n examples whose feature is their index (a batch shows which examples it holds)."""
    return TensorDataset(torch.arange(n).float().unsqueeze(1))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


class _MySampler(SequentialSampler):
    """A subclass may yield anything: only the two torch classes themselves qualify."""


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_and_random_samplers_without_replacement_qualify(shuffle, drop_last):
    assert problem(DataLoader(_dataset(), batch_size=3, shuffle=shuffle,
                              drop_last=drop_last)) is None


def _refused_loaders() -> list[tuple[object, str]]:
    data = _dataset()
    return [
        (DataLoader(data, batch_size=3, sampler=WeightedRandomSampler([1.0] * N, N)),
         "WeightedRandomSampler"),
        (DataLoader(data, batch_size=3, sampler=RandomSampler(data, replacement=True)),
         "with replacement"),
        (DataLoader(data, batch_size=3, sampler=RandomSampler(data, num_samples=N - 2)),
         "num_samples=8"),
        (DataLoader(data, batch_sampler=[[0, 1], [1, 2]]), "custom batch_sampler"),
        (DataLoader(data, batch_size=3, sampler=_MySampler(data)), "_MySampler"),
        (DataLoader(data, batch_size=3, sampler=SequentialSampler(_dataset(N + 5))),
         "another data source"),
        (DataLoader(_Stream(), batch_size=3), "IterableDataset"),
        (DataLoader(data, batch_size=N + 1, drop_last=True), "no batch"),
        ([[0, 1]], "not a torch DataLoader"),
    ]


@pytest.mark.parametrize("loader, reason", _refused_loaders())
def test_a_loader_that_may_repeat_an_example_in_a_pass_is_refused_with_its_reason(loader, reason):
    assert reason in problem(loader)
    with pytest.raises(ConfigError, match="sampling='shuffle'") as refusal:
        check_given_shuffle(loader, 0.3)
    assert reason in str(refusal.value)


@pytest.mark.parametrize("size, batch, drop_last", [(10, 3, False), (10, 3, True), (12, 4, True),
                                                     (7, 7, False), (1000, 64, True)])
def test_the_sample_rate_makes_one_pass_of_the_loader_an_epoch(size, batch, drop_last):
    loader = DataLoader(_dataset(size), batch_size=batch, drop_last=drop_last)
    rate = given_shuffle_rate(loader)
    assert steps_per_epoch(rate) == len(loader)
    if not drop_last or size % batch == 0:
        assert rate == batch / size  # dptrain's shuffle of the same loader has the same q


def test_a_plan_rate_whose_epoch_is_not_one_pass_is_refused():
    loader = DataLoader(_dataset(), batch_size=3, drop_last=True)  # 3 batches a pass
    with pytest.raises(ConfigError, match="one pass is 3 batches"):
        check_given_shuffle(loader, 0.3)  # an epoch of 4 steps


def _indices(batch: list[torch.Tensor]) -> list[int]:
    return batch[0].flatten().long().tolist()


def test_the_wrapper_yields_the_callers_batches_in_their_order():
    loader = DataLoader(_dataset(), batch_size=3)
    kept = GivenShuffleLoader(loader, given_shuffle_rate(loader))
    assert [_indices(b) for b in kept] == [_indices(b) for b in loader]
    assert len(kept) == len(loader) and kept.dataset is loader.dataset


def test_a_pass_broken_off_is_resumed_so_each_epoch_holds_an_example_once():
    loader = DataLoader(_dataset(), batch_size=3, shuffle=True)  # 4 batches a pass
    kept = GivenShuffleLoader(loader, given_shuffle_rate(loader))
    loops: list[list[list[int]]] = []
    for _ in range(3):  # loops that each stop after 3 batches
        loops.append([])
        for step, batch in enumerate(kept):
            loops[-1].append(_indices(batch))
            if step == 2:
                break
    assert [len(loop) for loop in loops] == [3, 1, 3]  # the 2nd loop finishes the 1st pass
    handed = [batch for loop in loops for batch in loop]
    first, second = sum(handed[:4], []), sum(handed[4:], [])
    assert sorted(first) == list(range(N)) and len(set(second)) == len(second) == 9


def test_every_batch_handed_out_is_announced():
    loader = DataLoader(_dataset(), batch_size=5)
    kept = GivenShuffleLoader(loader, given_shuffle_rate(loader))
    heard: list[int] = []
    kept.add_hand_out_listener(lambda: heard.append(1))
    for _ in kept:
        pass
    assert len(heard) == 2


def test_the_wrapper_refuses_a_loader_that_does_not_qualify():
    data = _dataset()
    with pytest.raises(ConfigError, match="WeightedRandomSampler"):
        GivenShuffleLoader(DataLoader(data, batch_sampler=BatchSampler(
            WeightedRandomSampler([1.0] * N, N), 3, False)), 0.3)
