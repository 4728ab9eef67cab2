"""The caller's own DataLoader charged as shuffled batches (privacy.sampling "given_shuffle").

The accounting of shuffled batches (dptrain.accounting.shuffle: substitution adjacency, no
amplification) charges each epoch of `steps_per_epoch(q)` consecutive steps, counted from the
first step, as one Gaussian release of every example. It needs only this of the batches: within
each such epoch every example is in at most one batch, and which batch positions there are
depends on N alone, never on the data. It uses neither the randomness of a permutation (it holds
were the permutation public) nor equal batch sizes (under a substitution a batch's clipped sum
moves by at most 2 C, whatever its size).

A torch DataLoader gives that when its batches are a plain `BatchSampler` (drop_last either way)
over a `SequentialSampler` or a `RandomSampler` without replacement over all N examples of its
own dataset: one pass puts each example in at most one of its len(loader) batches. `problem`
says why another loader does not qualify (a weighted, replacing or custom sampler, a custom
batch_sampler, an IterableDataset). `given_shuffle_rate` is the q whose epoch,
`steps_per_epoch(q)`, is one pass of the loader.

`GivenShuffleLoader` keeps the caller's loader (its batches, order, workers and collate) and
makes its passes the accountant's epochs: a pass is always finished before the next one starts
(a loop that breaks off resumes the pass where it stopped at its next iteration), and the DP
optimizer hears of every batch handed out (the engine then refuses a step that skips or merges
one, so that step t releases batch t of the passes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from dptrain.accounting.history import steps_per_epoch
from dptrain.accounting.shuffle import check_epochs_aligned
from dptrain.data.batch_record import BatchRecord
from dptrain.errors import ConfigError


def _sampler_problem(sampler: Any, dataset: Any) -> str | None:
    """Why `sampler` may put an example of `dataset` in two batches of one pass (None: never)."""
    if type(sampler) not in (SequentialSampler, RandomSampler):
        return f"its sampler is a {type(sampler).__name__}, not a SequentialSampler or RandomSampler"
    if getattr(sampler, "data_source", None) is not dataset:
        return "its sampler draws from another data source than the loader's dataset"
    if type(sampler) is RandomSampler and sampler.replacement:
        return "its RandomSampler draws with replacement (an example can be in several batches)"
    if type(sampler) is RandomSampler and sampler.num_samples != len(dataset):
        return (f"its RandomSampler draws num_samples={sampler.num_samples} of the "
                f"{len(dataset)} examples (a pass must be one permutation of all of them)")
    return None


def problem(data_loader: Any) -> str | None:
    """Why `data_loader` cannot be charged as shuffled batches (None: it can): the one rule for
    which caller's loader puts each example in at most one batch of each pass."""
    if not isinstance(data_loader, DataLoader):
        return f"it is a {type(data_loader).__name__}, not a torch DataLoader"
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset):
        return "its dataset is an IterableDataset (no sampler: the examples' batches are unknown)"
    batch_sampler = data_loader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        return (f"its batches come from a custom batch_sampler ({type(batch_sampler).__name__}), "
                "not a plain BatchSampler")
    reason = _sampler_problem(batch_sampler.sampler, dataset)
    if reason is None and len(data_loader) == 0:
        reason = (f"it has no batch (batch_size={data_loader.batch_size} > {len(dataset)} "
                  "examples with drop_last=True)")
    return reason


def given_shuffle_rate(data_loader: Any) -> float:
    """q of a qualifying loader of L = len(loader) batches of B over N examples: B / N when
    steps_per_epoch(B / N) = ceil(N / B) is L (drop_last=False, or N a multiple of B), else 1 / L,
    so that the accountant's epoch is always one pass. q N is the averaged gradient's public
    denominator (B, or N / L: between B and B + 1 when drop_last drops N mod B examples).
    ConfigError for a loader that does not qualify (`problem`)."""
    reason = problem(data_loader)
    if reason is not None:
        raise _refusal(reason)
    batches = len(data_loader)
    rate = data_loader.batch_size / len(data_loader.dataset)  # type: ignore[arg-type]
    return rate if steps_per_epoch(rate) == batches else 1.0 / batches


def check_given_shuffle(data_loader: Any, sample_rate: float) -> None:
    """ConfigError unless `data_loader` qualifies (`problem`) and its pass is the epoch of
    `sample_rate` (the plan's q)."""
    reason = problem(data_loader)
    if reason is None and steps_per_epoch(sample_rate) != len(data_loader):
        reason = (f"one pass is {len(data_loader)} batches while the plan's sample rate "
                  f"{sample_rate:.6g} makes an epoch {steps_per_epoch(sample_rate)} steps")
    if reason is not None:
        raise _refusal(reason)


def _refusal(reason: str) -> ConfigError:
    """The error for a data_loader that cannot be charged as shuffled batches, and the fix."""
    return ConfigError(
        "sampling='given_shuffle' keeps the data_loader and charges each of its passes as one "
        "Gaussian release of every example, which holds only for a torch DataLoader whose "
        "batches are a plain BatchSampler over a SequentialSampler or a RandomSampler without "
        f"replacement over all of its dataset; this data_loader does not qualify: {reason}. Use "
        "sampling='shuffle' (dptrain's own shuffle of the same dataset, the same accounting) or "
        "sampling='poisson'.")


class GivenShuffleLoader:
    """The caller's DataLoader, its passes made the accountant's epochs (module docstring).

    Iterating it yields the wrapped loader's batches; len() is its batches per pass. Other
    attributes (dataset, batch_size, ...) are the wrapped loader's.
    """

    def __init__(self, data_loader: DataLoader, sample_rate: float) -> None:
        check_given_shuffle(data_loader, sample_rate)
        self.data_loader = data_loader
        self.sample_rate = sample_rate
        self._iterator: Iterator[Any] | None = None  # the current pass of the wrapped loader
        self._handed_out = 0                          # batches of the current pass handed out
        self._listeners: list[Callable[[], None]] = []
        self._record: BatchRecord | None = None      # of the batch handed out last
        self._count = 0                               # batches handed out by this wrapper

    def __len__(self) -> int:
        return len(self.data_loader)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current pass, or a new pass once the current one is finished."""
        if self._iterator is None or self._handed_out >= len(self):
            self._iterator, self._handed_out = iter(self.data_loader), 0
        return self._batches(self._iterator)

    def _batches(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._handed_out += 1
            # the caller's sampler chose the rows (not known here); q is the pass's 1 / steps
            self._record = BatchRecord(index=self._count, sample_rate=self.sample_rate)
            self._count += 1
            for listener in self._listeners:
                listener()
            yield batch

    @property
    def position(self) -> int:
        """Batches of the current pass handed out (0 at the start of a pass)."""
        return self._handed_out % len(self)

    def check_aligned(self, steps_charged: int) -> None:
        """PrivacyError unless an accountant holding `steps_charged` steps starts its epochs
        where this loader starts its passes: otherwise the next pass would begin inside an epoch
        already charged, and an example could be in two batches of it, charged once."""
        check_epochs_aligned(steps_charged, self.position, len(self), "sampling='given_shuffle'")

    def last_record(self) -> BatchRecord | None:
        """The record of the batch most recently handed to the loop (rows unknown: the caller's
        sampler drew them); None before the first."""
        return self._record

    def add_hand_out_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` each time a batch reaches the training loop."""
        self._listeners.append(listener)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "data_loader":
            raise AttributeError(name)
        return getattr(self.data_loader, name)


__all__ = ["GivenShuffleLoader", "check_given_shuffle", "given_shuffle_rate", "problem"]
