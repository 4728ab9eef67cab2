"""DistributedDataParallel models in `make_private`: unwrap them (the engine picks the parts).

`PrivacyEngine.make_private(module=DDP(model), ...)` trains privately across the DDP processes:

* The per-sample gradient module (hooks or ghost) wraps the INNER module (`ddp.module`), and the
  returned module is that wrapper: the training loop calls it, not the DDP wrapper. DDP's own
  gradient all-reduce is thereby avoided entirely (not just postponed with `no_sync`): DDP's
  reducer only acts after a forward through the DDP wrapper, which never happens. Its sync of
  plain gradients would be wasted work (the DP optimizer overwrites p.grad from the all-reduced
  clipped sums plus noise) and, with virtual batches or empty Poisson shards, ranks run
  different numbers of forward passes, which DDP's per-forward collectives cannot survive.
  Constructing DDP still does its useful part: it broadcasts rank 0's parameters and buffers, so
  every rank starts from the same model.
* The loader's sampler is sharded (`dptrain.data.sharding`: each rank yields its shard of every
  batch; q is global) and
  the optimizer a `DistributedDPOptimizer` (clipped sums all-reduced, noise added once).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dptrain.errors import ConfigError


def unwrap_ddp(module: Any) -> tuple[Any, bool]:
    """(inner module, True) for a DDP-wrapped model, else (module, False).

    Raises ConfigError when the DDP model uses a process group other than the default (world)
    group: the distributed sampler and optimizer span the world group.
    """
    if not isinstance(module, DistributedDataParallel):
        return module, False
    group = getattr(module, "process_group", None)
    world = dist.group.WORLD
    if group is not None and world is not None and dist.get_world_size(group) != dist.get_world_size(world):
        raise ConfigError("module is a DistributedDataParallel model over a process subgroup: "
                          "make_private supports DDP over the default (world) process group only. "
                          "Wrap the model with DistributedDataParallel(model) without process_group.")
    inner: nn.Module = module.module
    return inner, True
