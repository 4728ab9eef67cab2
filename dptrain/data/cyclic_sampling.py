"""Cyclic Poisson sampling: the data split once into b groups, group t mod b Poisson-sampled at
step t (Choquette-Choo et al. 2023, "Amplified banded matrix factorization").

Each of the N examples joins one of the b groups, uniformly at random and independently of every
other example, once per run (`partition`). At step t, each example of group t mod b joins the
batch independently with probability q_group = b q, and no other example does. q keeps the
meaning it has for Poisson sampling, each example's share of a batch per step on average (b q
once every b steps), so an epoch is still ceil(1 / q) steps, the expected batch size is q N
(a group holds N / b examples on average, Binomial(N, 1 / b)) and the noise is divided by the
public q N as for Poisson batches. An example takes part at most once every b steps: what banded
correlated noise of b bands needs for its amplified accounting
(dptrain.accounting.matrix_factorization).

Why independent groups, not an equal split: the accounting is stated for add/remove (datasets
differing by one example). With groups drawn independently, adding an example draws its own
group and leaves every other example's as it was (the same coins give the same groups:
example i's group is the i-th draw), so neighbouring datasets give runs that differ by that one
example's participations alone, and the charge of one example sampled at rate b q at its group's
steps holds whatever group it drew. An equal split (a permutation, then index mod b, as dptrain
drew before) re-partitions the others when an example is added (N = 1442, b = 2: 721/721
becomes 722/720), so it supports only zero-out or replace-one; a checkpoint written then keeps
its equal split when resumed (`EQUAL_SPLIT`), with a warning.

The partition is NOT secret: the accounting holds for a known partition (it charges the group
whose turn it is as a Poisson-sampled batch), so its seed (`partition_seed`, 62 bits drawn from
the sampling generator, or the OS CSPRNG in secure mode) is always in `state_dict`, with the
SHA-256 of the groups it gives, and a resumed run keeps its groups exactly (or is refused); the
coins of each step are as secret as Poisson sampling's.

The step index t is the number of batches this sampler handed to the training loop: batches
drawn ahead by a DataLoader and abandoned (a loop that breaks out of an epoch) are forgotten and
their step indices drawn again, so that step t of the run is always group t mod b.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch

from dptrain.data.sampling import (
    DPDataLoader,
    PoissonBatchSampler,
    _loader_kwargs,
    loader_sample_rate,
)
from dptrain.data.sharding import RankSharded, shard_sampler
from dptrain.distributed.consistency import check_same_on_every_rank
from dptrain.distributed.runtime import broadcast_object, is_distributed
from dptrain.errors import ConfigError, PrivacyError
from dptrain.randomness import make_generator, secure_seed, uniform


#: How a run's groups were drawn (`CyclicPoissonBatchSampler.partition_kind`): INDEPENDENT,
#: each example's group uniform and independent of the others' (add/remove holds); EQUAL_SPLIT,
#: the equal split of checkpoints written before, kept for the run that started with it.
INDEPENDENT, EQUAL_SPLIT = "independent", "equal_split"


def partition(num_samples: int, groups: int, seed: int) -> torch.Tensor:
    """The group of each example, LongTensor [num_samples] with values in [0, groups): each
    uniform and independent of the others (group sizes Binomial(num_samples, 1 / groups)).

    Example i's group is the i-th draw of one generator seeded with `seed` (torch's CPU kernel
    draws the values in order), so the groups of num_samples + 1 examples begin with those of
    num_samples: adding an example never moves another."""
    return torch.randint(0, groups, (num_samples,), generator=make_generator(seed),
                         dtype=torch.long)


def equal_split(num_samples: int, groups: int, seed: int) -> torch.Tensor:
    """The partition of checkpoints written before groups were drawn independently (only to
    resume such a run as it began), LongTensor [num_samples]: a random permutation perm (from
    `seed`) and group[perm[j]] = j mod groups, sizes differing by at most one. Valid under
    zero-out or replace-one only: adding an example re-partitions the others."""
    order = torch.randperm(num_samples, generator=make_generator(seed))
    group = torch.empty(num_samples, dtype=torch.long)
    group[order] = torch.arange(num_samples, dtype=torch.long) % groups
    return group


_PARTITIONS = {INDEPENDENT: partition, EQUAL_SPLIT: equal_split}


def partition_digest(group: torch.Tensor) -> str:
    """SHA-256 (hex) of a partition's groups, LongTensor [N]: what a resume checks it rebuilt."""
    return hashlib.sha256(group.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def check_groups(groups: Any, sample_rate: float, num_samples: int | None = None) -> int:
    """The number of groups; ConfigError naming privacy.sampling_groups unless it is an integer
    >= 1 with groups * q <= 1 (each group sampled at rate groups * q) and, when N is given,
    groups <= N (every group can expect an example; a group drawn empty gives empty batches)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ConfigError(f"privacy.sampling_groups={groups!r} must be an integer >= 1 (the "
                          "number of groups of cyclic Poisson sampling).")
    if num_samples is not None and groups > num_samples:
        raise ConfigError(f"privacy.sampling_groups={groups} exceeds the {num_samples} examples: "
                          "every group needs an example. Use fewer groups.")
    if groups * sample_rate > 1.0 + 1e-12:
        raise ConfigError(
            f"privacy.sampling_groups={groups} with sample rate q={sample_rate:.4g}: each group "
            f"would be sampled at groups * q = {groups * sample_rate:.4g} > 1. The expected batch "
            f"size q N must fit in one group of N / groups examples: use at most "
            f"{int(1 / sample_rate)} groups or a smaller batch size.")
    return groups


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """Batches of cyclic Poisson sampling over range(num_samples) (see the module docstring).

    Args:
        num_samples: N, the dataset size.
        sample_rate: q, each example's share of a batch per step (the group's rate is
            groups * q); the rate every batch is recorded with.
        groups: b, the number of groups (b q <= 1).
        steps, generator, secure: as `PoissonBatchSampler` (no sample-rate schedule).
        partition_seed: the seed of the partition (None: drawn at the first batch from the
            sampling generator, or the OS CSPRNG in secure mode).
    """

    def __init__(self, num_samples: int, sample_rate: float, groups: int,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 secure: bool = False, partition_seed: int | None = None) -> None:
        super().__init__(num_samples, sample_rate, steps=steps, generator=generator,
                         secure=secure)
        self.groups = check_groups(groups, self.sample_rate, self.num_samples)
        self.group_rate = min(1.0, self.groups * self.sample_rate)
        self.partition_seed = partition_seed
        #: INDEPENDENT, or EQUAL_SPLIT when restored from a checkpoint that drew one
        self.partition_kind = INDEPENDENT
        self._group: torch.Tensor | None = None

    # -- the partition ---------------------------------------------------------------------
    def new_partition_seed(self) -> int:
        """A fresh 62-bit partition seed from the sampling generator (the OS CSPRNG in secure
        mode)."""
        if self.secure:
            return secure_seed()
        return int(torch.randint(0, 2**62, (1,), generator=self.generator).item())

    @property
    def group_of(self) -> torch.Tensor:
        """The group of each example, LongTensor [N] (the partition is drawn on first use)."""
        if self.partition_seed is None:
            self.partition_seed = self.new_partition_seed()
        if self._group is None:
            draw = _PARTITIONS[self.partition_kind]
            self._group = draw(self.num_samples, self.groups, self.partition_seed)
        return self._group

    def group_at(self, step: int) -> int:
        """The group sampled at step `step`: step mod groups."""
        return int(step) % self.groups

    # -- drawing ---------------------------------------------------------------------------
    def _candidates(self, group: int) -> torch.Tensor:
        """The examples this sampler may draw at a step of `group`, LongTensor [n]."""
        return (self.group_of == group).nonzero().flatten()

    def draw_batch(self) -> list[int]:
        """One batch: each example of group (step mod groups) with probability groups * q (the
        coins drawn for `draws_for(members)`)."""
        members = self.draws_for(self._candidates(self.group_at(self.batches_drawn)))
        mask = uniform(len(members), self.generator, self.secure) < self.group_rate
        self.batches_drawn += 1
        return members[mask].tolist()

    def forget_pending(self) -> None:
        """Forget the batches drawn and not handed out (an abandoned iterator's prefetch): the
        next batch drawn is that of the next step handed out, of the group of that step."""
        self.batches_drawn -= len(self.pending)
        self.pending.clear()

    def agree_over_ranks(self, group: Any = None) -> None:
        """Sharded over ranks (`dptrain.data.sharding.shard_sampler`, a collective): every rank
        must hold the same groups, so the same number of groups and rank 0's partition seed,
        drawn now when unset (from the generator the ranks share, as its first draw, where one
        process draws it at its first batch; or each rank's CSPRNG in secure mode) and taken
        from rank 0. Without other processes an unset seed is left to the first batch."""
        check_same_on_every_rank({"sampling_groups": self.groups}, "the cyclic Poisson loader",
                                 "every rank must split the data into the same number of groups "
                                 "(privacy.sampling_groups).", group=group)
        mine = self.partition_seed
        if mine is None and is_distributed():
            mine = self.new_partition_seed()
        seed = broadcast_object(mine, group=group)
        if seed != self.partition_seed:
            self.partition_seed, self._group = seed, None   # groups drawn again from rank 0's

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As `PoissonBatchSampler.state_dict` (steps counted as handed out), with the
        partition (always: it is not secret, and must survive a resume): its kind, its seed and
        the SHA-256 of the groups they give (None before the first batch drew them)."""
        state = super().state_dict()
        state["batches_drawn"] = self.batches_drawn - len(self.pending)
        state["groups"] = self.groups
        state["partition"] = self.partition_kind
        state["partition_seed"] = self.partition_seed
        state["partition_sha256"] = (None if self.partition_seed is None
                                     else partition_digest(self.group_of))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output: the same groups (ConfigError for another number of
        groups, PrivacyError when the seed rebuilds other groups than the saved ones) and the
        step count. A state without `partition` was written when groups were an equal split:
        the run keeps it (an example changing group mid-run could take part twice in b steps),
        with a warning that its guarantee is zero-out, not add/remove."""
        if int(state.get("groups", self.groups)) != self.groups:
            raise ConfigError(f"the checkpoint's sampler split the data into {state['groups']} "
                              f"groups, this run into {self.groups}: resume with "
                              f"privacy.sampling_groups={state['groups']}.")
        if state.get("partition_seed") is not None:
            self._restore_partition(int(state["partition_seed"]),
                                    state.get("partition", EQUAL_SPLIT),
                                    state.get("partition_sha256"))
        super().load_state_dict(state)
        self.pending.clear()

    def _restore_partition(self, seed: int, kind: str, digest: str | None) -> None:
        """Rebuild the saved partition (`kind` drawn from `seed`); PrivacyError, nothing
        changed, when its SHA-256 is not `digest` (another torch draws other groups)."""
        if kind not in _PARTITIONS:
            raise PrivacyError(f"the checkpoint's cyclic Poisson groups were drawn as {kind!r}, "
                               f"which this dptrain does not know ({sorted(_PARTITIONS)}).")
        group = _PARTITIONS[kind](self.num_samples, self.groups, seed)
        if digest is not None and partition_digest(group) != digest:
            raise PrivacyError(
                "the checkpoint's cyclic Poisson groups cannot be rebuilt: its partition seed "
                "gives other groups here (another version of torch?), and examples changing "
                "group mid-run could take part twice within privacy.sampling_groups steps. "
                "Resume with the torch version that wrote the checkpoint, or start a new run.")
        if kind == EQUAL_SPLIT:
            warnings.warn(
                "this checkpoint's cyclic Poisson groups are an equal split (written before "
                "dptrain drew each example's group independently); the resumed run keeps them, "
                "and its epsilon holds for zero-out neighbours (one example's contribution "
                "replaced by nothing, the dataset size kept), not add/remove. Start a new run for "
                "an add/remove guarantee.", UserWarning, stacklevel=3)
        self.partition_seed, self.partition_kind, self._group = seed, kind, group


class DistributedCyclicPoissonBatchSampler(RankSharded, CyclicPoissonBatchSampler):
    """This rank's part of each cyclic Poisson batch: a `CyclicPoissonBatchSampler` sharded when
    built (`dptrain.data.sharding.shard_sampler`, a collective over several processes): the
    sampled members i of the step's group with i % W == rank, every rank holding rank 0's
    partition (`agree_over_ranks`)."""

    def __init__(self, num_samples: int, sample_rate: float, groups: int, *,
                 rank: int | None = None, world_size: int | None = None, group: Any = None,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 secure: bool = False) -> None:
        super().__init__(num_samples, sample_rate, groups, steps=steps, generator=generator,
                         secure=secure)
        shard_sampler(self, rank, world_size, group)


class CyclicPoissonDataLoader(DPDataLoader):
    """A DataLoader whose batches are cyclic Poisson samples (see `CyclicPoissonBatchSampler`);
    `sample_rate` is q (the group's rate is groups * q)."""

    def __init__(self, dataset: Any, sample_rate: float, *, groups: int,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 secure: bool = False, collate_fn: Any = None, **loader_kwargs: Any) -> None:
        sampler = CyclicPoissonBatchSampler(len(dataset), sample_rate, groups, steps=steps,
                                            generator=generator, secure=secure)
        self._init_loader(dataset, sampler, collate_fn, loader_kwargs)

    def __iter__(self) -> Any:
        """A fresh iterator; the batches an abandoned one drew ahead are drawn again."""
        self.poisson_sampler.forget_pending()  # type: ignore[attr-defined]
        return super().__iter__()

    @classmethod
    def from_data_loader(cls, data_loader: Any, *, sample_rate: float | None = None,
                         groups: int = 1, generator: torch.Generator | None = None,
                         secure: bool = False, sample_rate_schedule: Any = None,
                         steps: int | None = None) -> CyclicPoissonDataLoader:
        """A cyclic Poisson loader over `data_loader`'s dataset (q = batch_size / N by
        default), keeping its workers and collate."""
        if sample_rate_schedule is not None:
            raise ConfigError("cyclic Poisson sampling keeps one sample rate for the whole run: "
                              "a sample_rate_schedule needs privacy.sampling=poisson.")
        return cls(data_loader.dataset, loader_sample_rate(data_loader, sample_rate),
                   groups=groups, steps=steps, generator=generator, secure=secure,
                   collate_fn=data_loader.collate_fn, **_loader_kwargs(data_loader))


class DistributedCyclicPoissonDataLoader(CyclicPoissonDataLoader):
    """A CyclicPoissonDataLoader whose batch sampler is a `DistributedCyclicPoissonBatchSampler`:
    each rank's loader yields that rank's shard of every logical batch (q and the groups are
    those of the whole dataset). Building it is a collective."""

    def __init__(self, dataset: Any, sample_rate: float, *, groups: int,
                 rank: int | None = None, world_size: int | None = None, group: Any = None,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 secure: bool = False, collate_fn: Any = None, **loader_kwargs: Any) -> None:
        sampler = DistributedCyclicPoissonBatchSampler(
            len(dataset), sample_rate, groups, rank=rank, world_size=world_size, group=group,
            steps=steps, generator=generator, secure=secure)
        self._init_loader(dataset, sampler, collate_fn, loader_kwargs)
