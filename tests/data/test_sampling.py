"""Poisson sampling: batch-size distribution, reproducibility, empty batches, loader rebuild."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dptrain.data.sampling import DPDataLoader, PoissonBatchSampler, ShuffleDataLoader, dataset_size
from dptrain.errors import ConfigError, PrivacyError


def _sizes(sampler) -> torch.Tensor:
    return torch.tensor([len(b) for b in sampler], dtype=torch.float64)


def test_batch_sizes_have_the_binomial_mean_and_variance():
    n, q, steps = 1000, 0.05, 4000
    sizes = _sizes(PoissonBatchSampler(n, q, steps=steps, generator=torch.Generator().manual_seed(0)))
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < 6 * math.sqrt(var / steps)
    # var of the sample variance of near-normal data: 2 var^2 / (steps - 1)
    assert abs(sizes.var().item() - var) < 6 * var * math.sqrt(2 / (steps - 1))


def test_each_example_is_included_with_probability_q():
    n, q, steps = 20, 0.3, 5000
    counts = torch.zeros(n)
    for batch in PoissonBatchSampler(n, q, steps=steps, generator=torch.Generator().manual_seed(1)):
        counts[batch] += 1
    tolerance = 6 * math.sqrt(q * (1 - q) / steps)
    assert ((counts / steps - q).abs() < tolerance).all()


def test_the_same_seed_gives_the_same_batches():
    first = list(PoissonBatchSampler(50, 0.1, generator=torch.Generator().manual_seed(3)))
    second = list(PoissonBatchSampler(50, 0.1, generator=torch.Generator().manual_seed(3)))
    assert first == second


def test_secure_sampling_differs_between_identical_samplers():
    first = list(PoissonBatchSampler(200, 0.5, steps=3, secure=True))
    second = list(PoissonBatchSampler(200, 0.5, steps=3, secure=True))
    assert first != second


def test_default_steps_per_epoch_is_one_over_q():
    assert len(PoissonBatchSampler(100, 0.04)) == 25


def test_sample_rate_outside_zero_one_is_a_privacy_error_naming_it():
    with pytest.raises(PrivacyError, match="sample_rate"):
        PoissonBatchSampler(10, 1.5)


def test_the_sample_rate_schedule_is_read_at_each_batch_index():
    sampler = PoissonBatchSampler(10, 1.0, steps=3, generator=torch.Generator().manual_seed(0),
                                  sample_rate_schedule=lambda t: 1.0 if t % 2 == 0 else 1e-12)
    assert [len(b) for b in sampler] == [10, 0, 10]


def test_sampler_state_dict_resumes_the_exact_sequence():
    sampler = PoissonBatchSampler(40, 0.2, steps=2, generator=torch.Generator().manual_seed(5))
    list(sampler)
    state = sampler.state_dict()
    expected = list(sampler)
    fresh = PoissonBatchSampler(40, 0.2, steps=2, generator=torch.Generator().manual_seed(99))
    fresh.load_state_dict(state)
    assert list(fresh) == expected and fresh.batches_drawn == 4


def test_empty_batches_are_zero_row_tensors_with_the_right_trailing_shape():
    dataset = TensorDataset(torch.randn(5, 3, 2), torch.arange(5))
    loader = DPDataLoader(dataset, sample_rate=1e-9, steps=2,
                          generator=torch.Generator().manual_seed(0))
    for x, y in loader:
        assert x.shape == (0, 3, 2) and x.dtype == torch.float32
        assert y.shape == (0,) and y.dtype == torch.int64


def test_an_empty_batch_of_a_collator_returning_its_own_mapping_type_has_no_rows():
    from transformers import BatchEncoding

    def collate(samples: list) -> BatchEncoding:   # as Hugging Face collators return
        return BatchEncoding({"input_ids": torch.stack([x for x, _ in samples]),
                              "labels": torch.stack([y for _, y in samples]),
                              "lengths": np.array([3] * len(samples))})

    dataset = TensorDataset(torch.randn(5, 3), torch.arange(5))
    loader = DPDataLoader(dataset, sample_rate=1e-9, steps=2, collate_fn=collate,
                          generator=torch.Generator().manual_seed(0))
    for batch in loader:   # never example 0's data: no example was drawn
        assert isinstance(batch, BatchEncoding)
        assert batch["input_ids"].shape == (0, 3) and batch["labels"].shape == (0,)
        assert batch["lengths"].shape == (0,)


def test_from_data_loader_keeps_the_dataset_collate_and_uses_batch_size_over_n():
    dataset = TensorDataset(torch.randn(40, 2), torch.arange(40))
    loader = DataLoader(dataset, batch_size=8, collate_fn=lambda s: ("custom", len(s)))
    private = DPDataLoader.from_data_loader(loader, generator=torch.Generator().manual_seed(0))
    assert private.sample_rate == pytest.approx(0.2)
    assert len(private) == 5
    assert all(batch[0] == "custom" for batch in private if batch[1] > 0)


@pytest.mark.parametrize("n, batch_size", [(1442, 128), (40, 8), (1000, 3), (7, 7)])
def test_a_poisson_epoch_has_the_steps_of_a_plain_loader_with_that_batch_size(n, batch_size):
    plain = DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=batch_size)
    assert len(PoissonBatchSampler(n, batch_size / n)) == len(plain)
    assert len(DPDataLoader.from_data_loader(plain)) == len(plain)


def test_a_dataset_without_length_is_a_config_error_naming_data_loader():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(ConfigError, match="data_loader"):
        dataset_size(DataLoader(Stream(), batch_size=1))


def test_secure_batch_sizes_have_the_binomial_mean():
    n, q, steps = 500, 0.1, 400
    sizes = _sizes(PoissonBatchSampler(n, q, steps=steps, secure=True))
    assert abs(sizes.mean().item() - n * q) < 6 * math.sqrt(n * q * (1 - q) / steps)


def _scheduled_loader(schedule, **loader_kwargs) -> DPDataLoader:
    dataset = TensorDataset(torch.arange(20.0).view(20, 1))
    return DPDataLoader(dataset, sample_rate=schedule(0), steps=6, sample_rate_schedule=schedule,
                        generator=torch.Generator().manual_seed(0), **loader_kwargs)


def test_the_loader_reports_the_sample_rate_each_handed_out_batch_was_drawn_with():
    def schedule(t):
        return 1.0 if t % 3 == 0 else 1e-12

    loader = _scheduled_loader(schedule)
    assert loader.batch_sample_rate() is None
    for t, (x,) in enumerate(loader):
        assert loader.batch_sample_rate() == schedule(t)
        assert len(x) == (20 if schedule(t) == 1.0 else 0)


def test_batches_prefetched_by_an_abandoned_iterator_are_not_reported_for_later_batches():
    def schedule(t):
        return 1.0 / (t + 1)

    loader = _scheduled_loader(schedule, num_workers=1, prefetch_factor=2)
    next(iter(loader))  # abandoned: it had drawn (prefetched) more batches than it handed out
    first_of_next = loader.poisson_sampler.batches_drawn
    assert first_of_next > 1
    next(iter(loader))
    assert loader.batch_sample_rate() == schedule(first_of_next)


def test_out_of_order_batches_are_a_config_error_naming_in_order():
    with pytest.raises(ConfigError, match="in_order=False"):
        DPDataLoader(TensorDataset(torch.zeros(4, 1)), sample_rate=0.5, in_order=False)


# -- shuffled batches (ShuffleBatchSampler, ShuffleDataLoader) -----------------------------------

def _index_loader(n: int = 10, batch_size: int = 3, **kwargs) -> ShuffleDataLoader:
    """A seeded shuffle over examples 0..n-1 whose batches are their indices."""
    data = TensorDataset(torch.arange(n))
    return ShuffleDataLoader(data, batch_size / n, generator=torch.Generator().manual_seed(0),
                             **kwargs)


def _windows_hold_each_example_once(batches: list[list[int]], steps: int) -> bool:
    """Whether every window of `steps` consecutive batches, counted from the first (the
    accountant's epochs), holds each example at most once."""
    for start in range(0, len(batches), steps):
        members = [i for batch in batches[start:start + steps] for i in batch]
        if len(members) != len(set(members)):
            return False
    return True


def test_shuffled_epochs_counted_in_steps_hold_each_example_once_when_iterators_are_abandoned():
    """An abandoned iterator had drawn batches ahead (worker prefetch) that never reach the loop:
    the next iterator draws them again, so batch t handed out is still batch t of the shuffles."""
    loader = _index_loader(num_workers=1, prefetch_factor=2)  # 4 batches per epoch
    handed_out: list[list[int]] = []
    for taken in (1, 2, 3, 2, 1, 3, 2, 2):
        iterator = iter(loader)
        for _ in range(taken):
            handed_out.append(next(iterator)[0].tolist())
        del iterator
    assert len(handed_out) == 16
    assert _windows_hold_each_example_once(handed_out, len(loader))


def test_an_older_iterator_of_a_shuffle_loader_is_refused_once_a_newer_one_started():
    """Two live iterators: the new one draws again the batches the old one prefetched, so the old
    one's next batch would repeat examples of the same epoch, charged once."""
    loader = _index_loader(num_workers=1, prefetch_factor=2)
    old = iter(loader)
    first = next(old)[0].tolist()
    new = iter(loader)
    with pytest.raises(PrivacyError, match="newer iterator of the same loader"):
        next(old)
    handed_out = [first, *(next(new)[0].tolist() for _ in range(3))]
    assert _windows_hold_each_example_once(handed_out, len(loader))


def test_an_older_iterator_of_a_poisson_loader_is_refused_once_a_newer_one_started():
    """The new iterator owns the record of each pending batch's sample rate."""
    loader = _scheduled_loader(lambda t: 1.0 / (t + 1))
    old = iter(loader)
    next(old)
    next(iter(loader))
    with pytest.raises(PrivacyError, match="Use one iterator at a time"):
        next(old)


def test_a_shuffle_saved_mid_epoch_without_its_shuffle_is_refused_and_changes_nothing():
    """An OS-entropy shuffle never saves its permutation: resumed mid-epoch, the rest of the
    epoch would come from a new shuffle and could repeat an example already trained on."""
    saved = ShuffleDataLoader(TensorDataset(torch.arange(10)), 0.3)  # OS entropy
    for _, _ in zip(range(2), saved):
        pass
    state = saved.poisson_sampler.state_dict()
    assert state["batches_drawn"] == 2 and "order" not in state
    resumed = ShuffleDataLoader(TensorDataset(torch.arange(10)), 0.3)
    with pytest.raises(PrivacyError, match="2 batches into an epoch of 4"):
        resumed.poisson_sampler.load_state_dict(state)
    assert resumed.poisson_sampler.batches_drawn == 0
    at_epoch_end = dict(state, batches_drawn=4)
    resumed.poisson_sampler.load_state_dict(at_epoch_end)  # a new epoch: a new shuffle is right
    assert resumed.poisson_sampler.batches_drawn == 4


def test_a_seeded_shuffle_saved_at_an_epoch_end_after_drawing_ahead_resumes_the_same_next_epoch():
    """A prefetching loader drew the next epoch's shuffle before the state was saved (the
    generator's saved state is past it): the resumed loader reuses it, so its batches are the
    uninterrupted loader's (a resume that replays steps as exact must draw the same batches)."""
    straight = _index_loader()
    reference = [b.tolist() for (b,) in straight] + [b.tolist() for (b,) in straight]
    loader = _index_loader(num_workers=1, prefetch_factor=2)   # 4 batches per epoch
    first = iter(loader)
    handed_out = [next(first)[0].tolist() for _ in range(2)]
    second = iter(loader)                  # starts at batch 2: its pass runs into epoch 1
    handed_out += [next(second)[0].tolist() for _ in range(2)]
    assert loader.poisson_sampler.batches_drawn > 4     # it drew batches of epoch 1 ahead
    state = loader.poisson_sampler.state_dict()
    resumed = _index_loader()
    resumed.poisson_sampler.load_state_dict(state)
    assert handed_out + [b.tolist() for (b,) in resumed] == reference


def test_a_seeded_shuffle_saved_mid_epoch_resumes_the_same_shuffle():
    saved = _index_loader()
    batches = [b.tolist() for _, (b,) in zip(range(2), saved)]
    resumed = _index_loader()
    resumed.poisson_sampler.load_state_dict(saved.poisson_sampler.state_dict())
    batches += [b.tolist() for _, (b,) in zip(range(2), resumed)]
    assert sorted(i for batch in batches for i in batch) == list(range(10))
