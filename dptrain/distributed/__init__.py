"""Distributed DP-SGD on torch.distributed: many processes, privacy unchanged.

* `DistributedPoissonBatchSampler` / `DistributedDPDataLoader`: each rank samples its
  rank-strided shard; the union is a Poisson sample of the whole dataset with rate q (a Poisson
  sampler sharded by `dptrain.data.sharding`, the rule of every selection scheme).
* `DistributedDPOptimizer`: clipped sums all-reduced across ranks, noise added once (rank 0).
* `unwrap_ddp`: `make_private` accepts a DistributedDataParallel model.
* `ShardedDPOptimizer`, `shard_model`, `model_state_dict`, `load_model_state_dict`: `make_private`
  accepts a model sharded with FSDP2's `fully_shard` (clipped sums reduce-scattered to the shards,
  each rank noising its own rows; whole state dicts at any number of ranks).
* `setup_from_env`, `relaunch_with_torchrun`: the `hardware=ddp` CLI glue.
* `check_same_config`, `check_same_on_every_rank`: every rank trains the same job, or every rank
  stops with one clear error (the loader and the DP optimizer check their arguments too).
* `is_main_process`, `get_rank`, `get_world_size`, `barrier`: rank-0-only writes and syncs.

Public names are imported lazily (importing this package does not import torch.distributed).
"""

from dptrain._lazy import lazy_attributes

_PUBLIC = {
    # The distributed sampler and DP optimizer are a sampler and a DP optimizer: they live in
    # dptrain.data.distributed and dptrain.privacy.distributed (above this package, which they
    # use); their names stay importable from here.
    "DistributedPoissonBatchSampler": "dptrain.data.distributed",
    "DistributedDPDataLoader": "dptrain.data.distributed",
    "DistributedDPOptimizer": "dptrain.privacy.distributed",
    "ShardedDPOptimizer": "dptrain.privacy.distributed",
    "unwrap_ddp": "dptrain.distributed.ddp",
    "shard_model": "dptrain.distributed.fsdp",
    "model_state_dict": "dptrain.distributed.fsdp",
    "load_model_state_dict": "dptrain.distributed.fsdp",
    "setup_from_env": "dptrain.distributed.launch",
    "relaunch_with_torchrun": "dptrain.distributed.launch",
    "check_same_config": "dptrain.distributed.consistency",
    "check_same_on_every_rank": "dptrain.distributed.consistency",
    "is_main_process": "dptrain.distributed.runtime",
    "get_rank": "dptrain.distributed.runtime",
    "get_world_size": "dptrain.distributed.runtime",
    "is_distributed": "dptrain.distributed.runtime",
    "barrier": "dptrain.distributed.runtime",
}

__all__ = sorted(_PUBLIC)


__getattr__ = lazy_attributes(__name__, _PUBLIC)
