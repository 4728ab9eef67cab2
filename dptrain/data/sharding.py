"""Sharding any index stream over ranks: the one rule of every selection scheme under DDP/FSDP.

Rank r of W owns the examples {r, r + W, r + 2W, ...} (`RankShare`: shares differ in size by at
most one, so W need not divide N), and trains, of every global batch, on the indices i with
i % W == r. `shard_sampler` makes any dptrain batch sampler (Poisson, cyclic Poisson, shuffled,
balls-in-bins) yield this rank's share; `shard_loader` does it to a private loader (what every
selection strategy's `private_loader` does under a distributed model, through
`LoaderContext.shard`). The `Distributed*` names of dptrain.data.distributed and
dptrain.data.cyclic_sampling are constructors over it, not other samplers.

* Generator mode (the default and the reproducible opt-in): every rank holds the same generator
  state (rank 0's, broadcast when sharded), draws every draw of the global batch and keeps its
  share, so the union of the shares is bit-for-bit the batch one process draws with that
  generator: the selection's accounting holds unchanged. By default rank 0's generator is seeded
  from OS entropy (the shared state is known to no one and never saved); with a caller's seeded
  generator a W-process run reproduces a one-process run.
* Secure mode: each rank draws from its own OS CSPRNG, and only the draws of the examples it
  owns (`RankShare.drawn`: N / W Poisson coins a rank, not N). This is allowed only for samplers
  whose draws are per example (`draws_per_example`): given the state every rank shares, each
  example's part in the batches is then decided by draws of its own, independent of every other
  example's, and drawn by exactly one rank with the distribution one process would use, so the
  union has the one-process distribution:

  - Poisson: example i joins a batch iff its own uniform u_i < q, the u_i independent.
  - cyclic Poisson: the partition is public and the same on every rank (rank 0's seed,
    broadcast: the sampler's `agree_over_ranks`); given it, example i of the step's group joins
    iff its own uniform < b q.
  - balls-in-bins: example i's batch of the epoch is its own uniform draw in [0, k).
  - shuffled batches draw one permutation of all N examples, not a draw per example: per-rank
    permutations would give other batch sizes, so secure sharding refuses them (ConfigError).

The clipped sums are all-reduced (DDP) or reduce-scattered (FSDP2) and noised once
(dptrain.privacy.distributed).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from dptrain.distributed.consistency import check_same_on_every_rank
from dptrain.distributed.runtime import get_rank, get_world_size, sync_generator
from dptrain.errors import ConfigError


@dataclass(frozen=True)
class RankShare:
    """Rank `rank` of `world_size`: the examples it owns (i % world_size == rank)."""

    rank: int
    world_size: int

    def owns(self, indices: torch.Tensor) -> torch.Tensor:
        """BoolTensor [n]: which of `indices` (LongTensor [n] of example indices) it owns."""
        return indices % self.world_size == self.rank

    def keep(self, batch: list[int]) -> list[int]:
        """The indices of `batch` this rank trains on (order kept)."""
        if self.world_size == 1:
            return batch
        indices = torch.tensor(batch, dtype=torch.long)
        return indices[self.owns(indices)].tolist()

    def indices(self, num_samples: int) -> torch.Tensor:
        """Its examples among range(num_samples), LongTensor [ceil((N - rank) / W)]."""
        return torch.arange(self.rank, num_samples, self.world_size)

    def drawn(self, candidates: torch.Tensor, secure: bool) -> torch.Tensor:
        """Which of `candidates` (LongTensor [n], the examples a per-example draw is made for,
        in order) this rank draws for. Outside secure mode all of them: the generator is shared,
        so every rank must advance it as one process would. In secure mode only its own: its
        CSPRNG is its own, and the owner of each other example draws for it."""
        return candidates[self.owns(candidates)] if secure else candidates


class RankSharded:
    """What a sampler built sharded (the `Distributed*` samplers) shows of its `RankShare`."""

    rank_share: RankShare
    num_samples: int

    @property
    def rank(self) -> int:
        return self.rank_share.rank

    @property
    def world_size(self) -> int:
        return self.rank_share.world_size

    @property
    def shard(self) -> torch.Tensor:
        """This rank's examples, LongTensor [N_r] (`RankShare.indices`)."""
        return self.rank_share.indices(self.num_samples)


def check_shard(num_samples: int, rank: int, world_size: int) -> None:
    """ConfigError unless 0 <= rank < world_size <= num_samples (every rank owns an example)."""
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be an integer >= 1 (the number of "
                          "processes; WORLD_SIZE under torchrun).")
    if isinstance(rank, bool) or int(rank) != rank or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r} must be an integer in [0, world_size={world_size}) "
                          "(RANK under torchrun).")
    if world_size > num_samples:
        raise ConfigError(f"world_size={world_size} processes but the dataset has only "
                          f"{num_samples} examples: every rank needs a shard of at least one "
                          "example. Use fewer processes (hardware.nproc_per_node / "
                          "hardware.nodes) or a larger dataset.")


def check_same_sampling(num_samples: int, sample_rate: float, steps: int | None, secure: bool,
                        scheduled: bool, group: Any = None, reproducible: bool = False) -> None:
    """ConfigError on every rank unless all ranks sample the same way: the same N, q, steps per
    epoch, secure mode, reproducibility of the coins (a seeded generator) and presence of a
    sample-rate schedule (one collective)."""
    check_same_on_every_rank(
        {"num_samples": num_samples, "sample_rate": sample_rate, "steps": steps,
         "secure": secure, "reproducible": reproducible, "sample_rate_schedule": scheduled},
        "the private data loader",
        "every rank must pass make_private a DataLoader over the WHOLE dataset with the same "
        "batch_size (the global expected batch size): dptrain gives each rank its shard itself, "
        "so do not pass a per-rank shard of the dataset; and every rank must build its "
        "PrivacyEngine with the same secure_mode and reproducible_mechanism.", group=group)


def shard_sampler(sampler: Any, rank: int | None = None, world_size: int | None = None,
                  group: Any = None) -> Any:
    """Make `sampler` (any dptrain batch sampler) yield this rank's share of every batch (its
    `draw()` keeps the share of the scheme's `draw_batch()`), and return it. A collective over
    several processes: the ranks check that they sample alike, then, outside secure mode, take
    rank 0's generator state, and agree on whatever else the sampler needs shared (its `agree_over_ranks(group)`, e.g. cyclic Poisson's partition).
    ConfigError in secure mode for a sampler whose draws are not per example (see the module
    docstring)."""
    rank = get_rank(group) if rank is None else rank
    world_size = get_world_size(group) if world_size is None else world_size
    if world_size != 1:
        check_same_sampling(sampler.num_samples, sampler.sample_rate, sampler.steps,
                            sampler.secure, sampler.sample_rate_schedule is not None,
                            group=group, reproducible=sampler.reproducible)
    check_shard(sampler.num_samples, rank, world_size)
    if world_size != 1 and sampler.secure and not sampler.draws_per_example:
        raise ConfigError(
            f"secure_mode with {getattr(sampler, 'mechanism', type(sampler).__name__)} over "
            f"{world_size} processes: its batches come from one draw over the whole dataset (a "
            "shuffle), which ranks drawing from their own OS CSPRNG cannot share, so the union "
            "of their shares would not be a batch of that selection. Use secure_mode=False (every "
            "rank then draws rank 0's stream), or privacy.sampling=poisson or balls_in_bins "
            "(one draw per example), or one process.")
    sampler.rank_share = RankShare(int(rank), int(world_size))
    if world_size != 1:
        if not sampler.secure:
            sync_generator(sampler.generator, group=group)
        agree = getattr(sampler, "agree_over_ranks", None)
        if agree is not None:
            agree(group)
    return sampler


def warn_distributed_sampler(data_loader: Any) -> None:
    """Warn when the caller's `data_loader` has a DistributedSampler (the usual DDP habit): the
    private loader ignores it, and reads its batch_size as the GLOBAL one."""
    if isinstance(getattr(data_loader, "sampler", None), DistributedSampler):
        warnings.warn(
            f"data_loader uses a DistributedSampler, which make_private ignores: each rank "
            f"samples its own shard of the whole dataset, batch_size={data_loader.batch_size} "
            "is read as the GLOBAL expected batch size (q = batch_size / N) and an epoch as "
            "ceil(N / batch_size) steps. Pass a plain DataLoader over the whole dataset with "
            "batch_size = the global expected batch size.", UserWarning, stacklevel=4)


def shard_loader(loader: Any, source: Any = None, rank: int | None = None,
                 world_size: int | None = None, group: Any = None) -> Any:
    """`loader` (a private loader over the WHOLE dataset) yielding this rank's share of every
    batch (`shard_sampler` on its batch sampler; a collective), returned; `source`, the caller's
    loader it was built from, is checked for a DistributedSampler (`warn_distributed_sampler`)."""
    if source is not None:
        warn_distributed_sampler(source)
    shard_sampler(loader.batch_sampler, rank, world_size, group)
    return loader


__all__ = [
    "RankSharded",
    "RankShare",
    "check_same_sampling",
    "check_shard",
    "shard_loader",
    "shard_sampler",
    "warn_distributed_sampler",
]
