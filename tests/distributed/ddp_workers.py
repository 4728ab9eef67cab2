"""Code that runs inside the spawned ranks of the distributed tests (and, for the references, in
the test process itself). Each worker writes its observations to `out_dir/rank{r}.pt`."""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Imported here, in the test process, so that the forked ranks inherit them instead of each
# importing them again (seconds per rank on a loaded machine).
# DistributedDataParallel() imports torch._dynamo lazily: seconds per rank, unless done here.
import torch._dynamo  # noqa: F401,E402
import dptrain.accounting.rdp  # noqa: F401,E402
import dptrain.grad_sample.ghost  # noqa: F401,E402
import dptrain.privacy.engine  # noqa: F401,E402
from dptrain.privacy.noise import Banded  # noqa: E402

N, FEATURES, CLASSES, BATCH = 40, 6, 3, 10
SEED = 1234
#: fork: the ranks inherit the imported modules (spawn re-imports torch: seconds per rank).
START_METHOD = "fork"


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 20.0) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _entry(rank: int, fn: Callable[..., dict[str, Any]], world_size: int, port: int,
           out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        result = fn(rank, world_size, port, *args)
    except BaseException as error:  # reported to the test, which fails with the traceback
        result = {"crash": traceback.format_exc(), "error_type": type(error).__name__}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., dict[str, Any]], out_dir: Path, world_size: int = 2,
              args: tuple = (), timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Run fn(rank, world_size, port, *args) on `world_size` spawned processes; their results.

    Fails (AssertionError) when the ranks do not all finish within `timeout_s` (a hang)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = mp.start_processes(_entry, args=(fn, world_size, free_port(), str(out_dir), args),
                                 nprocs=world_size, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"ranks still running after {timeout_s} s: a hang")
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# ----------------------------------------------------------------------------- training runs
def make_problem() -> tuple[nn.Module, TensorDataset]:
    """A tiny float64 MLP and dataset, identical on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(N, FEATURES, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()
    return model, TensorDataset(x, y)


def train_private(distributed: bool, steps: int, noise_multiplier: float,
                  grad_sample_mode: str = "hooks", physical: int | None = None,
                  clipping: str = "flat", lr: float = 0.5,
                  count_noise_std: float | None = None, batch: int = BATCH,
                  noise_strategy: Any = None) -> dict[str, Any]:
    """`steps` DP-SGD steps; DDP-wrapped when `distributed`. Returns parameters, the accountant's
    history, every step's noise (p.grad * (q N) - p.summed_grad) and this rank's batch indices.
    A correlated `noise_strategy` gets the batch selection it picks (banded: cyclic Poisson in
    as many groups as bands)."""
    from dptrain import BatchMemoryManager
    from dptrain.privacy.engine import PrivacyEngine

    model, data = make_problem()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = DataLoader(data, batch_size=batch)
    engine = PrivacyEngine(accountant="rdp", seed=SEED, reproducible_mechanism=True)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=noise_multiplier, max_grad_norm=0.3,
        grad_sample_mode=grad_sample_mode, clipping=clipping,
        count_noise_std=count_noise_std, noise_strategy=noise_strategy)
    batches: list[list[int]] = []
    noises: list[torch.Tensor] = []
    optimizer.attach_step_hook(lambda opt: noises.append(torch.cat(  # summed_grad: hooks only
        [(p.grad * opt.expected_batch_size - p.summed_grad).flatten() for p in opt.params])))
    sampler = loader.batch_sampler
    original_draw = sampler.draw
    sampler.draw = lambda: batches.append(original_draw()) or batches[-1]
    done = 0
    while done < steps:  # epochs of len(loader) logical steps
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical or N,
                                optimizer=optimizer) as physical_loader:
            for x, y in physical_loader:
                optimizer.zero_grad()
                if len(x) > 0:
                    nn.functional.cross_entropy(module(x), y).backward()
                optimizer.step()
                if not optimizer.link.last_step_skipped:
                    done += 1
                if done == steps:
                    break
    params = torch.cat([p.detach().flatten() for p in module.parameters()])
    return {"params": params, "history": list(engine.accountant.history), "batches": batches,
            "noise": torch.stack(noises), "bound": optimizer.max_grad_norm}


# correlated noise: banded, 3 bands (dptrain.privacy.noise)
BANDED = Banded((1.0, 0.5, 0.25))

SCENARIOS: dict[str, dict[str, Any]] = {
    "hooks_noise0": dict(steps=6, noise_multiplier=0.0),
    "hooks_noise": dict(steps=6, noise_multiplier=1.3),
    "ghost_virtual_noise0": dict(steps=6, noise_multiplier=0.0, grad_sample_mode="ghost", physical=2),
    "hooks_virtual_noise": dict(steps=6, noise_multiplier=1.3, physical=3),
    "adaptive_noise": dict(steps=6, noise_multiplier=1.0, clipping="adaptive",
                           count_noise_std=2.0),
    "per_layer_noise": dict(steps=6, noise_multiplier=1.3, clipping="per_layer"),
    # q = 1/40: each rank's shard of 20 examples is empty in ~60% of the steps.
    "empty_shards_noise": dict(steps=12, noise_multiplier=1.3, batch=1, physical=1),
    "noise_std": dict(steps=40, noise_multiplier=1.0, lr=0.0),   # 40 steps x 83 coordinates
    "banded_virtual_noise": dict(steps=6, noise_multiplier=1.3, physical=3,
                                 noise_strategy=BANDED),
}


def scenarios_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Every scenario of SCENARIOS on this rank, under one process group."""
    init_gloo(rank, world_size, port)
    return {name: train_private(True, **kwargs) for name, kwargs in SCENARIOS.items()}


def default_sampling_worker(rank: int, world_size: int, port: int, sample_rate: float,
                            steps: int) -> dict[str, Any]:
    """Two DistributedDPDataLoaders built with the defaults over range(N), each after the same
    torch.manual_seed(SEED) (the public seed): for each, its sampling generator's state once
    built and this rank's first `steps` batches."""
    from dptrain.data.distributed import DistributedDPDataLoader

    init_gloo(rank, world_size, port)
    loaders = []
    for _ in range(2):
        torch.manual_seed(SEED)
        loader = DistributedDPDataLoader(TensorDataset(torch.arange(N)), sample_rate=sample_rate)
        state = loader.batch_sampler.generator.get_state()
        loaders.append({"state": state,
                        "batches": [b.tolist() for (b,), _ in zip(loader, range(steps))]})
    return {"loaders": loaders}


# ----------------------------------------------------------------------------- the CLI's train()
def compose(*overrides: str) -> Any:
    """The composed dptrain config with `overrides` (Hydra's compose API, no run folder)."""
    from hydra import compose as hydra_compose, initialize_config_module

    with initialize_config_module("dptrain.conf", version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def train_cli(run_dir: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """build_job + train as `dptrain` runs them; the result and what the run folder holds."""
    from dptrain.cli.build import build_job
    from dptrain.train.loop import train

    job, settings = build_job(compose(*overrides), Path(run_dir))
    result = train(job, settings)
    params = torch.cat([_full(p).detach().flatten() for p in job.model.parameters()])
    return {"status": result.status, "steps": result.steps, "epsilon": result.epsilon,
            "test_accuracy": result.test_accuracy, "params": params,
            "history": list(job.engine.accountant.history) if job.engine else None}


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole: gathered from the ranks when it is sharded (a DTensor: hardware=fsdp)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def cli_worker(rank: int, world_size: int, port: int, run_dir: str,
               runs: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """`train_cli` for each override tuple of `runs` in turn, with torchrun's environment set.

    `run_dir` may contain "{rank}": each rank then passes its own folder, as Hydra does when the
    ranks start at different seconds; the ranks must agree on rank 0's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return {"runs": [train_cli(run_dir.format(rank=rank), overrides) for overrides in runs]}


# ----------------------------------------------------------------------------- bad input
def _error_of(fn: Callable[[], Any]) -> str | None:
    """The ConfigError message `fn` raised, or None when it returned."""
    from dptrain.errors import ConfigError

    try:
        fn()
    except ConfigError as error:
        return str(error)
    return None


def errors_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Each bad input on this rank: the message it raised (None: no error)."""
    from dptrain.distributed.consistency import check_same_config
    from dptrain.distributed.launch import DDPSettings, setup_from_env

    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    good = DDPSettings(nproc_per_node=world_size, timeout_s=20)
    out: dict[str, Any] = {
        "nccl": _error_of(lambda: setup_from_env(DDPSettings(world_size, backend="nccl"), env)),
        "world": _error_of(lambda: setup_from_env(DDPSettings(world_size + 1), env)),
    }
    logging.getLogger().setLevel(logging.INFO)   # as the command configures it
    setup_from_env(good, env)
    out["logs_progress"] = logging.getLogger("dptrain.train").isEnabledFor(logging.INFO)
    out["logs_warnings"] = logging.getLogger("dptrain.train").isEnabledFor(logging.WARNING)
    out["config"] = _error_of(lambda: check_same_config({"train": {"epochs": 1 + rank}, "seed": 0}))
    out["same_config"] = _error_of(lambda: check_same_config({"train": {"epochs": 1}}))
    out["node_local_root"] = _error_of(lambda: check_same_config({"dataset": {"root": f"/n{rank}"}}))
    out["non_poisson"] = _error_of(lambda: _make_private(poisson_sampling=False,
                                                         allow_non_poisson=True))
    out["shard_as_dataset"] = _error_of(lambda: _make_private(examples=N - rank))
    out["clipping_norm"] = _error_of(lambda: _make_private(max_grad_norm=1.0 + rank))
    out["same_arguments"] = _error_of(lambda: _make_private())
    return out


def _make_private(examples: int = N, **overrides: Any) -> Any:
    """make_private of a DDP model over the first `examples` examples (kwargs override)."""
    from dptrain.privacy.engine import PrivacyEngine

    model, data = make_problem()
    ddp = nn.parallel.DistributedDataParallel(model)
    kwargs = dict(module=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1),
                  data_loader=DataLoader(TensorDataset(*data[:examples]), batch_size=BATCH),
                  noise_multiplier=1.0, max_grad_norm=1.0)
    return PrivacyEngine(accountant="rdp", seed=SEED).make_private(**{**kwargs, **overrides})


def missing_rank_worker(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Rank 1 stops before joining; rank 0 tries to join with a 1 s timeout."""
    from dptrain.distributed.launch import DDPSettings, setup_from_env

    if rank == 1:
        return {"joined": False}
    env = {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    message = _error_of(lambda: setup_from_env(DDPSettings(world_size, timeout_s=1), env))
    return {"error": message, "waited_s": time.monotonic() - start}
