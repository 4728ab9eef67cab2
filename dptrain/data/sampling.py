"""Poisson sampling: each example joins each batch independently with probability q.

`PoissonBatchSampler` yields lists of indices whose lengths are Binomial(N, q) (possibly 0);
`DPDataLoader.from_data_loader(loader)` rebuilds a loader around it, keeping the dataset, the
workers and the collate function, and yielding empty batches as tensors with 0 rows and the right
trailing shape (the default collate cannot collate an empty list).

Each batch drawn gets a record (`dptrain.data.batch_record.BatchRecord`: its index, q, rows),
published when the batch is handed to the training loop (`DPDataLoader.last_record()`), so the DP
optimizer and the accountant use the q a batch was really drawn with, even when a DataLoader
prefetches batches or a loop skips one.

The coin flips come from `dptrain.randomness.uniform`: by default a torch.Generator seeded from
OS entropy (the batches cannot be rebuilt from any user seed, and its state is never saved), a
caller's seeded generator (reproducible, an opt-in: whoever knows its seed knows every batch), or,
in secure mode, the OS CSPRNG.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from dptrain.accounting.calibration import steps_per_epoch
from dptrain.accounting.shuffle import check_epochs_aligned
from dptrain.checks import check_sample_rate
from dptrain.data.batch_record import BatchRecord
from dptrain.errors import ConfigError, PrivacyError
from dptrain.randomness import entropy_generator, uniform


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches of a Poisson-sampled subset of range(num_samples).

    Args:
        num_samples: N, the dataset size.
        sample_rate: q in (0, 1], each example's inclusion probability per batch.
        steps: batches per epoch (default `steps_per_epoch(q)` = ceil(1 / q), the trainer's and
            the planner's epoch).
        generator: a seeded CPU torch.Generator, for reproducible batches (an opt-in: NOT a
            guarantee if its seed is known, since the batches then are). Default None: a
            generator seeded from OS entropy, independent of torch's global RNG and of every
            seed, whose state `state_dict` leaves out.
        secure: draw the coin flips from the OS CSPRNG instead (generator ignored).
        sample_rate_schedule: optional fn(batch_index) -> q; batch_index counts every batch this
            sampler has drawn (across epochs), so q follows the optimizer's step count even when
            a DataLoader prefetches batches.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None) -> None:
        if int(num_samples) != num_samples or num_samples < 1:
            raise ConfigError(f"num_samples={num_samples!r} must be a dataset size >= 1.")
        self.num_samples = int(num_samples)
        self.sample_rate = check_sample_rate(sample_rate, "sample_rate")
        if steps is None:
            steps = steps_per_epoch(self.sample_rate)
        if int(steps) != steps or steps < 1:
            raise ConfigError(f"steps={steps!r} must be an integer >= 1 (batches per epoch).")
        self.steps = int(steps)
        self.secure = bool(secure)
        #: True when the coins come from a caller-seeded generator (replayable from its seed).
        self.reproducible = generator is not None and not self.secure
        if generator is None and not self.secure:
            generator = entropy_generator()
        self.generator = generator
        self.sample_rate_schedule = sample_rate_schedule
        self.batches_drawn = 0
        self._scheduled: tuple[int, float] | None = None  # (batch index, q) last evaluated
        #: the record of each batch drawn by the current iterator and not yet handed out,
        #: oldest first
        self.pending: deque[BatchRecord] = deque()
        #: the record of the batch most recently handed to the training loop (None before)
        self.handed_out_record: BatchRecord | None = None
        #: fn() called each time a batch reaches the training loop (the DP optimizer's check).
        self.hand_out_listeners: list[Callable[[], None]] = []
        #: iterators of the loader started so far; only the newest may hand out batches
        self.iterators_started = 0
        #: this rank's share of every batch drawn (dptrain.data.sharding); None: all of it
        self.rank_share: Any = None

    #: each example's part in a batch is decided by draws of its own (`draws_for`), so ranks in
    #: secure mode may each draw only their own examples' (dptrain.data.sharding)
    draws_per_example = True

    def draws_for(self, candidates: torch.Tensor) -> torch.Tensor:
        """The examples among `candidates` (LongTensor [n], in draw order) whose draws this
        process makes: all of them, or, sharded over ranks, those its `rank_share` draws for
        (`RankShare.drawn`: only its own in secure mode)."""
        if self.rank_share is None:
            return candidates
        return self.rank_share.drawn(candidates, self.secure)

    def __len__(self) -> int:
        return self.steps

    def _rate(self) -> float:
        """q of the batch about to be drawn (index `batches_drawn`), evaluated once per index."""
        if self.sample_rate_schedule is None:
            return self.sample_rate
        index = self.batches_drawn
        if self._scheduled is None or self._scheduled[0] != index:
            self._scheduled = (index, self.rate_at(index))
        return self._scheduled[1]

    def rate_at(self, index: int) -> float:
        """q the schedule gives batch `index` (counted over every batch drawn), checked: the one
        evaluator of a sample-rate schedule."""
        if self.sample_rate_schedule is None:
            return self.sample_rate
        return check_sample_rate(self.sample_rate_schedule(index),
                                 f"sample_rate_schedule (value at batch {index})")

    def upcoming_rates(self, count: int) -> list[float]:
        """q of the next `count` batches the training loop will receive, in order: those drawn
        ahead and not handed out yet at the q they were drawn with, then the schedule at the
        indices still to be drawn. The one evaluator of q by batch: the budget forecast reads
        it, so the q it commits for a step is the q the batch that step releases is drawn with,
        whatever batches a loop skipped before."""
        rates = [record.sample_rate for record in self.pending][:count]
        index = self.batches_drawn
        while len(rates) < count:
            rates.append(self.rate_at(index))
            index += 1
        return rates

    @property
    def handed_out_rate(self) -> float | None:
        """q of the batch most recently handed to the training loop (None before the first)."""
        record = self.handed_out_record
        return None if record is None else record.sample_rate

    def hand_out(self) -> None:
        """Publish the oldest drawn batch's record: it has reached the training loop
        (`handed_out_record`); then tell the listeners."""
        self.handed_out_record = self.pending.popleft() if self.pending else None
        for listener in self.hand_out_listeners:
            listener()

    def draw_record(self) -> BatchRecord:
        """Draw the next batch (`draw`: this rank's share) and make its record: its index, the
        q it was drawn with and the rows."""
        index, rate = self.batches_drawn, self._rate()
        return self._record(index, rate, self.draw())

    def _record(self, index: int, rate: float, batch: list[int]) -> BatchRecord:
        """The record of batch `index` (a sampler with more to say about a batch adds it)."""
        return BatchRecord(index=index, sample_rate=rate, indices=tuple(batch))

    def draw(self) -> list[int]:
        """The next batch this process trains on: the scheme's `draw_batch()`, of which a
        sampler sharded over ranks keeps this rank's share (dptrain.data.sharding)."""
        batch = self.draw_batch()
        return batch if self.rank_share is None else self.rank_share.keep(batch)

    def draw_batch(self) -> list[int]:
        """One Poisson batch: the indices i with uniform_i < q (sorted; possibly empty), the
        uniforms drawn for `draws_for(range(N))`."""
        rate = self._rate()
        candidates = self.draws_for(torch.arange(self.num_samples))
        mask = uniform(len(candidates), self.generator, self.secure) < rate
        self.batches_drawn += 1
        return candidates[mask].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            record = self.draw_record()
            self.pending.append(record)
            yield list(record.indices or ())

    def state_dict(self) -> dict[str, Any]:
        """Batches drawn and, only for reproducible coins, the generator state (exact resume). A
        generator seeded from OS entropy is left out: a resumed run draws fresh coins, so its
        replayed steps are new, independent Poisson samples (never the same batches with new
        noise, which the accountant could not count as independent steps)."""
        state: dict[str, Any] = {"batches_drawn": self.batches_drawn}
        if self.reproducible:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_drawn = int(state["batches_drawn"])
        if self.reproducible and state.get("generator") is not None:
            self.generator.set_state(state["generator"])


class ShuffleBatchSampler(PoissonBatchSampler):
    """Fixed-size batches of a fresh shuffle of range(num_samples) each epoch.

    Every example is in exactly one batch per epoch: batches of B = round(q N) examples (the
    last of an epoch holds the rest), `steps` = ceil(1 / q) = ceil(N / B) batches per epoch. The
    permutation is drawn from `dptrain.randomness.uniform` (argsort of N uniforms) with the same
    generator rules as the Poisson coins. Accounted without amplification
    (dptrain.accounting.shuffle); the batches' members must still stay secret.

    Batch i (counted over the whole run) is slice i mod steps of epoch i // steps's shuffle, so
    that the accountant's epochs (steps counted from the first) are the shuffle's epochs as long
    as step t releases batch t: batches a DataLoader drew ahead and an abandoned iterator dropped
    are drawn again (`forget_pending`, from the same epoch's shuffle), and the DP optimizer
    refuses a step after a batch handed out and not stepped on.
    """

    #: the selection in the words of a refusal
    mechanism = "sampling='shuffle'"
    #: one permutation of all N examples, not a draw per example
    draws_per_example = False

    def __init__(self, num_samples: int, sample_rate: float,
                 generator: torch.Generator | None = None, secure: bool = False) -> None:
        super().__init__(num_samples, sample_rate, generator=generator, secure=secure)
        self.batch_size = max(1, round(self.sample_rate * self.num_samples))
        #: the shuffle of each epoch still needed (the epoch of the next batch handed out, and
        #: the later ones batches were drawn ahead from), epoch index -> permutation of range(N)
        self._orders: dict[int, list[int]] = {}

    @property
    def handed_out(self) -> int:
        """Batches handed to the training loop so far (drawn, minus those still pending)."""
        return self.batches_drawn - len(self.pending)

    def _order(self, epoch: int) -> list[int]:
        """The shuffle of `epoch` (drawn on its first batch); earlier epochs are forgotten."""
        current = self.handed_out // self.steps
        self._orders = {e: o for e, o in self._orders.items() if e >= current}
        if epoch not in self._orders:
            self._orders[epoch] = self._draw_epoch()
        return self._orders[epoch]

    def _draw_epoch(self) -> list[int]:
        """A new epoch's order: a permutation of range(N) (argsort of N uniforms)."""
        return torch.argsort(uniform(self.num_samples, self.generator, self.secure)).tolist()

    def draw_batch(self) -> list[int]:
        """The next batch: slice (batches_drawn mod steps) of its epoch's shuffle."""
        epoch, position = divmod(self.batches_drawn, self.steps)
        order = self._order(epoch)
        self.batches_drawn += 1
        start = position * self.batch_size
        end = self.num_samples if position == self.steps - 1 else start + self.batch_size
        return sorted(order[start:end])

    def forget_pending(self) -> None:
        """Forget the batches drawn and not handed out (an abandoned iterator's prefetch): they
        are drawn again, the same slices of the same shuffles, for the steps that release them."""
        self.batches_drawn = self.handed_out
        self.pending.clear()

    @property
    def position(self) -> int:
        """Batches of the current epoch handed out (0 at the start of an epoch)."""
        return self.handed_out % self.steps

    def state_dict(self) -> dict[str, Any]:
        """As the Poisson sampler's, batches counted as handed out; when reproducible, with the
        current epoch's shuffle (a mid-epoch resume continues it) and the shuffles of later
        epochs a DataLoader already drew batches from (`ahead`: the generator state saved is past
        them, so a resume must reuse them to draw what an uninterrupted run draws)."""
        state = super().state_dict()
        state["batches_drawn"] = self.handed_out
        epoch = self.handed_out // self.steps
        if self.reproducible and self.position and epoch in self._orders:
            state["order"] = list(self._orders[epoch])
        if self.reproducible:
            ahead = {str(e): list(o) for e, o in self._orders.items()
                     if e > epoch or (e == epoch and not self.position)}
            if ahead:
                state["ahead"] = ahead
        return state

    def saved_position(self, state: Mapping[str, Any]) -> int:
        """The epoch position (batches of its epoch handed out) a saved state resumes at."""
        return int(state["batches_drawn"]) % self.steps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output. PrivacyError (nothing changed) for a state saved
        inside an epoch without its shuffle (OS-entropy or secure randomness never saves it):
        the rest of the epoch would come from a new shuffle, and an example could be in two
        batches of one charged epoch."""
        position = self.saved_position(state)
        order = state.get("order") or []
        if position and len(order) != self.num_samples:
            raise PrivacyError(
                f"the saved shuffle sampler stopped {position} batches into an epoch of "
                f"{self.steps}, and its shuffle was not saved (only reproducible randomness "
                "saves it): the rest of the epoch would come from a new shuffle, where an example "
                "already trained on in this epoch could be drawn again, charged once. Resume "
                f"from a state saved at the end of an epoch (a multiple of {self.steps} steps), "
                "or make both runs reproducible (PrivacyEngine(seed=..., "
                "reproducible_mechanism=True)) to resume mid-epoch.")
        super().load_state_dict(state)
        self.pending.clear()
        epoch = self.batches_drawn // self.steps
        self._orders = {epoch: list(order)} if position else {}
        if self.reproducible:
            self._orders.update({int(e): list(o) for e, o in state.get("ahead", {}).items()})


def _empty_like(batch: Any) -> Any:
    """The same structure with every tensor and array cut to 0 rows (lists emptied, scalars and
    strings kept). Every mapping is walked, not only dicts: a collator's own mapping type (a
    Hugging Face BatchEncoding) would otherwise pass through whole, and an empty Poisson batch
    would train on the example the shape was taken from."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_empty_like(b) for b in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_empty_like(b) for b in batch)
    if isinstance(batch, Mapping):
        emptied = {k: _empty_like(v) for k, v in batch.items()}
        try:
            return type(batch)(emptied)
        except TypeError:   # a mapping type that cannot be built from a dict
            return emptied
    return batch


class EmptyBatchCollate:
    """Wrap a collate function so an empty index list gives a 0-row batch of the right shape.

    The shape and dtype come from collating dataset[0] and cutting every tensor to 0 rows.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], dataset: Dataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) > 0:
            return self.collate_fn(samples)
        return _empty_like(self.collate_fn([self.dataset[0]]))


def dataset_size(data_loader: DataLoader, argument: str = "data_loader") -> int:
    """N = len(data_loader.dataset), or ConfigError naming `argument` when it has no length."""
    dataset = getattr(data_loader, "dataset", None)
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        size = None
    if not size:
        raise ConfigError(f"{argument} must be a torch DataLoader over a map-style dataset with a "
                          f"known, non-zero length (got dataset {type(dataset).__name__}): Poisson "
                          "sampling and privacy accounting need N. Iterable datasets are not "
                          "supported.")
    return int(size)


class _HandOutIterator:
    """A DataLoader iterator that tells the sampler when each batch reaches the loop.

    Batches arrive in the order their indices were drawn (the DataLoader keeps order), so the
    i-th batch handed out is the i-th one drawn for this iterator; `len()` and other attributes
    are the wrapped iterator's. Only the loader's newest iterator hands out batches: a new one
    takes over the sampler's pending batches, so an older one raises PrivacyError when asked for
    another batch.
    """

    def __init__(self, iterator: Iterator[Any], sampler: PoissonBatchSampler) -> None:
        sampler.iterators_started += 1
        self._iterator = iterator
        self._sampler = sampler
        self._number = sampler.iterators_started

    def __iter__(self) -> _HandOutIterator:
        return self

    def __next__(self) -> Any:
        if self._number != self._sampler.iterators_started:
            raise PrivacyError(
                "a batch was asked of an iterator of a private DataLoader after a newer iterator "
                "of the same loader was started (iter(loader) again). The new iterator has taken "
                "over the sampler: the batches this one drew ahead are drawn again for it, and "
                "the sample rate recorded for each batch is the new iterator's, so a batch from "
                "this one could repeat examples of the same shuffled epoch or be charged at "
                "another batch's rate. Use one iterator at a time: drop this one (or finish it) "
                "before calling iter(loader) again.")
        batch = next(self._iterator)
        self._sampler.hand_out()
        return batch

    def __len__(self) -> int:
        return len(self._iterator)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


class DPDataLoader(DataLoader):
    """A DataLoader whose batches are Poisson samples (see `PoissonBatchSampler`).

    `sample_rate` is the initial q and `len(loader)` the batches per epoch; `last_record()` is
    the record (q, rows) of the batch the loop received last.
    """

    def __init__(self, dataset: Dataset, sample_rate: float, *, steps: int | None = None,
                 generator: torch.Generator | None = None, secure: bool = False,
                 sample_rate_schedule: Callable[[int], float] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **loader_kwargs: Any) -> None:
        sampler = PoissonBatchSampler(len(dataset), sample_rate, steps=steps, generator=generator,
                                      secure=secure, sample_rate_schedule=sample_rate_schedule)
        self._init_loader(dataset, sampler, collate_fn, loader_kwargs)

    def _init_loader(self, dataset: Dataset, sampler: PoissonBatchSampler,
                     collate_fn: Callable[[list[Any]], Any] | None,
                     loader_kwargs: dict[str, Any]) -> None:
        """DataLoader.__init__ over `sampler`'s batches (empty ones collated to 0-row tensors)."""
        from torch.utils.data.dataloader import default_collate

        if loader_kwargs.get("in_order", True) is False:
            raise ConfigError(f"{type(self).__name__}(in_order=False): batches must reach the loop "
                              "in the order they were sampled, so that each step uses and accounts "
                              "the sample rate of its own batch. Drop in_order=False.")
        DataLoader.__init__(self, dataset, batch_sampler=sampler,
                            collate_fn=EmptyBatchCollate(collate_fn or default_collate, dataset),
                            **loader_kwargs)
        self.sample_rate = sampler.sample_rate

    @property
    def poisson_sampler(self) -> PoissonBatchSampler:
        return self.batch_sampler  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """A fresh iterator; batches an abandoned iterator prefetched are forgotten (never used)."""
        self.poisson_sampler.pending.clear()
        return _HandOutIterator(super().__iter__(), self.poisson_sampler)

    def add_hand_out_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` each time a batch of this loader reaches the training loop."""
        self.poisson_sampler.hand_out_listeners.append(listener)

    def last_record(self) -> BatchRecord | None:
        """The record of the batch most recently handed to the loop (None before the first): the
        step that releases that batch takes its q from it (dptrain.data.batch_record)."""
        return self.poisson_sampler.handed_out_record

    def batch_sample_rate(self) -> float | None:
        """q with which the batch most recently handed to the loop was sampled (None before the
        first batch): `last_record().sample_rate`."""
        return self.poisson_sampler.handed_out_rate

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, sample_rate: float | None = None,
                         generator: torch.Generator | None = None, secure: bool = False,
                         sample_rate_schedule: Callable[[int], float] | None = None,
                         steps: int | None = None) -> DPDataLoader:
        """A Poisson loader over `data_loader`'s dataset, keeping its workers and collate.

        The default q is batch_size / N (or 1 / len(data_loader) when it has a batch sampler),
        and the default steps per epoch `steps_per_epoch(q)` = ceil(1 / q): len(data_loader)
        for a loader over N examples in batches of B (drop_last=False).
        """
        return cls(data_loader.dataset, loader_sample_rate(data_loader, sample_rate),
                   steps=steps, generator=generator, secure=secure,
                   sample_rate_schedule=sample_rate_schedule, collate_fn=data_loader.collate_fn,
                   **_loader_kwargs(data_loader))


class ShuffleDataLoader(DPDataLoader):
    """A DataLoader of fixed-size batches from a shuffle each epoch (see ShuffleBatchSampler)."""

    #: the epoch-bound index stream it draws from (a subclass may cut epochs otherwise)
    sampler_class: type[ShuffleBatchSampler] = ShuffleBatchSampler

    def __init__(self, dataset: Dataset, sample_rate: float, *,
                 generator: torch.Generator | None = None, secure: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None, **loader_kwargs: Any) -> None:
        sampler = self.sampler_class(len(dataset), sample_rate, generator=generator, secure=secure)
        self._init_loader(dataset, sampler, collate_fn, loader_kwargs)

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, sample_rate: float | None = None,
                         generator: torch.Generator | None = None, secure: bool = False,
                         sample_rate_schedule: Callable[[int], float] | None = None,
                         steps: int | None = None) -> ShuffleDataLoader:
        """A shuffling loader over `data_loader`'s dataset (q = batch_size / N by default)."""
        if sample_rate_schedule is not None or steps is not None:
            raise ConfigError("shuffled batches have a fixed size and epoch: a sample_rate_schedule "
                              "or steps needs Poisson sampling.")
        return cls(data_loader.dataset, loader_sample_rate(data_loader, sample_rate),
                   generator=generator, secure=secure, collate_fn=data_loader.collate_fn,
                   **_loader_kwargs(data_loader))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """A fresh iterator; the batches an abandoned one drew ahead are drawn again."""
        self.poisson_sampler.forget_pending()  # type: ignore[attr-defined]
        return super().__iter__()

    def check_aligned(self, steps_charged: int, position: int | None = None) -> None:
        """PrivacyError unless an accountant holding `steps_charged` steps starts its epochs
        where this loader starts its shuffles (`check_epochs_aligned`), the loader being at
        its sampler's `position` in its epoch (default: where it is now)."""
        sampler = self.poisson_sampler
        at = sampler.position if position is None else position  # type: ignore[attr-defined]
        check_epochs_aligned(steps_charged, at, sampler.steps, sampler.mechanism)


def loader_sample_rate(data_loader: DataLoader, sample_rate: float | None) -> float:
    """`sample_rate`, or the default q of `data_loader` when None (`default_sample_rate`),
    checked: the q a private loader built from `data_loader` samples with."""
    if sample_rate is None:
        sample_rate = default_sample_rate(data_loader, dataset_size(data_loader))
    return check_sample_rate(sample_rate, "data_loader batch_size / N")


def default_sample_rate(data_loader: DataLoader, size: int) -> float:
    """q = batch_size / N for a DataLoader with a batch_size, else 1 / len(data_loader)."""
    if isinstance(data_loader, DPDataLoader):
        return data_loader.sample_rate
    if data_loader.batch_size is not None:
        return data_loader.batch_size / size
    return 1.0 / len(data_loader)


def _loader_kwargs(data_loader: DataLoader) -> dict[str, Any]:
    """The worker/memory settings of `data_loader` that a rebuilt loader should keep."""
    kwargs: dict[str, Any] = {
        "num_workers": data_loader.num_workers,
        "pin_memory": data_loader.pin_memory,
        "timeout": data_loader.timeout,
        "worker_init_fn": data_loader.worker_init_fn,
        "multiprocessing_context": data_loader.multiprocessing_context,
        "persistent_workers": data_loader.persistent_workers,
    }
    if data_loader.num_workers > 0:
        kwargs["prefetch_factor"] = data_loader.prefetch_factor
    return kwargs

