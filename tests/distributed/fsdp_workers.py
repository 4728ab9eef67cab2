"""Code that runs inside the spawned ranks of the FSDP2 tests (and, for the references, in the
test process itself): the same private training on a model sharded with `fully_shard` over the
ranks, or whole on one process. Launched with `ddp_workers.run_ranks` (forked gloo ranks)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_workers
from ddp_workers import init_gloo

# Imported here, in the test process, so that the forked ranks inherit them.
import torch.distributed.fsdp  # noqa: F401,E402
import torch.distributed.tensor  # noqa: F401,E402

SEED = 1234
N = 40


def mlp_problem() -> tuple[nn.Module, TensorDataset, Callable[[nn.Module, Any], torch.Tensor]]:
    """The DDP tests' float64 MLP and dataset, and its loss(module, batch)."""
    model, data = ddp_workers.make_problem()
    return model, data, lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1])


def _shard(model: nn.Module, units: Callable[[nn.Module], list[nn.Module]],
           mp_policy: Any = None) -> nn.Module:
    """fully_shard each of `units(model)`, then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for unit in units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_parameters(module: nn.Module) -> torch.Tensor:
    """Every parameter, gathered when sharded, flattened in model order."""
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                      for p in module.parameters()])


def train_private(problem: Callable[[], tuple], sharded: bool, steps: int,
                  noise_multiplier: float, grad_sample_mode: str = "hooks", lr: float = 0.5,
                  batch: int = 10, units: Callable[[nn.Module], list[nn.Module]] = lambda m: [],
                  mp_policy: Any = None, max_grad_norm: float = 0.3) -> dict[str, Any]:
    """`steps` DP-SGD steps on `problem()`, fully sharded when `sharded`: the final parameters
    (gathered), the accountant's history and every step's noise of this rank's rows."""
    from dptrain.privacy.engine import PrivacyEngine

    model, data, loss_fn = problem()
    if sharded:
        model = _shard(model, units, mp_policy)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    engine = PrivacyEngine(accountant="rdp", seed=SEED, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch),
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        grad_sample_mode=grad_sample_mode)
    noises: list[torch.Tensor] = []
    optimizer.attach_step_hook(lambda opt: noises.append(torch.cat(
        [_local(p.grad * opt.expected_batch_size - p.summed_grad).flatten() for p in opt.params])))
    done = 0
    while done < steps:
        for batch_ in loader:
            optimizer.zero_grad()
            loss_fn(module, batch_).backward()  # every rank, even on an empty shard (FSDP)
            optimizer.step()
            done += 1
            if done == steps:
                break
    return {"params": full_parameters(model), "history": list(engine.accountant.history),
            "noise": torch.stack(noises), "epsilon": engine.get_epsilon(1e-5)}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def scenarios_worker(rank: int, world_size: int, port: int,
                     scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every scenario (train_private's kwargs) on this rank, under one process group."""
    init_gloo(rank, world_size, port)
    return {name: train_private(sharded=True, **kwargs) for name, kwargs in scenarios.items()}
