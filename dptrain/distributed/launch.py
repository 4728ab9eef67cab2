"""`hardware=ddp`: start (or join) the torchrun processes, the process group, and check configs.

Two ways in, same result:

* The user starts the processes: `torchrun --nproc_per_node=2 -m dptrain.cli.main hardware=ddp
  ...` (multi-node: the same on every node with --nnodes/--node_rank/--rdzv_endpoint, see
  docs/distributed.md). Each process reads RANK / WORLD_SIZE / LOCAL_RANK.
* `dptrain hardware=ddp hardware.nproc_per_node=2 ...` without torchrun: the process re-launches
  itself through `python -m torch.distributed.run --standalone` with the same overrides (and,
  given the parent's Hydra config, its --config-dir / --config-name and hydra.* overrides) and
  its own run folder (`hydra.run.dir`), waits, and exits with torchrun's status.
* A multi-task SLURM step (hydra/launcher=slurm): every task reads SLURM_PROCID / SLURM_NTASKS /
  SLURM_LOCALID instead.

Every rank then joins the process group (gloo on CPU, nccl on CUDA; `hardware.backend`) with a
timeout (`hardware.timeout_s`) on the rendezvous and every collective, so no rank can hang
forever, and checks that its resolved config equals rank 0's. Checks that could fail on one rank
only are made from what every rank shares (config, environment) before the first collective, or
are collective themselves (every rank sees the same outcome).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dptrain.checks import POSITIVE_INT, POSITIVE_NUMBER
from dptrain.distributed.consistency import check_same_config
from dptrain.distributed.runtime import broadcast_object
from dptrain.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")
#: hardware.device values under hardware=ddp (a fixed cuda:N would put every rank on one GPU).
DDP_DEVICES = ("auto", "cpu", "cuda")
#: Environment variables torchrun sets in every worker (their presence means "already launched").
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
#: MASTER_PORT of a SLURM job: base + job id mod span (see `slurm_master_port`).
MASTER_PORT_BASE, MASTER_PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class DDPSettings:
    """The `hardware` group of `hardware=ddp`, checked.

    Attributes:
        nproc_per_node: processes per machine (one per GPU; on CPU, processes sharing the cores).
        nodes: machines; world size = nodes * nproc_per_node.
        backend: "auto" (nccl when CUDA is available, else gloo), "gloo" or "nccl".
        timeout_s: seconds any rendezvous or collective may wait before every rank fails.
        device: `hardware.device` (auto, cpu, cuda, cuda:N).
    """

    nproc_per_node: int
    nodes: int = 1
    backend: str = "auto"
    timeout_s: float = 300.0
    device: str = "auto"

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def ddp_settings(hardware: Mapping[str, Any] | None) -> DDPSettings | None:
    """DDPSettings when `hardware.distributed` is true (hardware=ddp), else None."""
    if not hardware or not hardware.get("distributed", False):
        return None
    backend = str(hardware.get("backend", "auto"))
    if backend not in BACKENDS:
        raise ConfigError(f"hardware.backend={backend!r} is not a torch.distributed backend "
                          f"dptrain supports: use one of {list(BACKENDS)} (auto: nccl on CUDA, "
                          "gloo on CPU).")
    device = str(hardware.get("device", "auto"))
    if device not in DDP_DEVICES:
        raise ConfigError(f"hardware.device={device!r} with hardware=ddp: every rank uses its own "
                          f"device (cuda:LOCAL_RANK), so use one of {list(DDP_DEVICES)} (pick the "
                          "GPUs with CUDA_VISIBLE_DEVICES).")
    timeout = POSITIVE_NUMBER.check(hardware.get("timeout_s", 300.0), "hardware.timeout_s")
    return DDPSettings(
        nproc_per_node=POSITIVE_INT.check(hardware.get("nproc_per_node", 1), "hardware.nproc_per_node"),
        nodes=POSITIVE_INT.check(hardware.get("nodes", 1), "hardware.nodes"), backend=backend,
        timeout_s=float(timeout), device=device)


def _slurm_tasks(env: Mapping[str, str]) -> int:
    """SLURM_NTASKS of a SLURM job step (0 outside SLURM)."""
    try:
        return int(env.get("SLURM_NTASKS", "0"))
    except ValueError:
        return 0


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when torchrun, or a multi-task SLURM step (hydra/launcher=slurm), started us."""
    env = os.environ if env is None else env
    return all(name in env for name in LAUNCHER_ENV) or (
        _slurm_tasks(env) > 1 and "SLURM_PROCID" in env)


def _first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list ("gpu[01-04],cpu7" -> "gpu01"), by scontrol."""
    fix = ("export MASTER_ADDR (the first node's host name) in the job's setup "
           "(hydra.launcher.setup).")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                               capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfigError(f"cannot find the master host of SLURM_JOB_NODELIST={nodelist!r} "
                          f"({error}): {fix}") from error
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host: {fix}")
    return hosts[0]


def slurm_master_port(env: Mapping[str, str]) -> str:
    """MASTER_PORT for a SLURM job: MASTER_PORT_BASE + SLURM_JOB_ID mod MASTER_PORT_SPAN.

    Derived from the job id (the same on every task of the job) so that two jobs sharing a node
    do not both try to listen on one port; below the Linux ephemeral range (32768+).
    """
    try:
        job = int(env.get("SLURM_JOB_ID", "0"))
    except ValueError:
        job = 0
    return str(MASTER_PORT_BASE + job % MASTER_PORT_SPAN)


def launcher_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT of this process.

    torchrun's variables when set; otherwise SLURM's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID; MASTER_ADDR the first host of the node list and MASTER_PORT
    `slurm_master_port`, unless exported).
    """
    env = dict(os.environ if env is None else env)
    if all(name in env for name in LAUNCHER_ENV) or _slurm_tasks(env) <= 1:
        return env
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_PORT", slurm_master_port(env))
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = _first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
    return env


def resolve_backend(backend: str, cuda: bool | None = None) -> str:
    """The backend to use: auto -> nccl with CUDA, gloo without; ConfigError if unavailable.

    Checked on every rank before any rendezvous, so an unusable backend fails everywhere at once.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if backend == "auto":
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not (cuda and dist.is_nccl_available()):
        raise ConfigError("hardware.backend=nccl needs CUDA GPUs and a torch build with NCCL, "
                          "and none is available on this machine: use hardware.backend=gloo "
                          "(or auto) to train on CPU.")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError("hardware.backend=gloo is not available in this torch build: use "
                          "hardware.backend=nccl on CUDA GPUs.")
    return backend


def _launcher_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError) as error:
        raise ConfigError(f"environment variable {name}={env.get(name)!r} must be an integer: "
                          "start dptrain with torchrun (see docs/distributed.md), which sets RANK, WORLD_SIZE and LOCAL_RANK.") from error


def check_world_size(world_size: int, settings: DDPSettings,
                     local_world_size: int | None = None) -> None:
    """ConfigError unless WORLD_SIZE == hardware.nodes * hardware.nproc_per_node and (when the
    launcher says, torchrun's LOCAL_WORLD_SIZE) the processes on this node == nproc_per_node."""
    if local_world_size is not None and local_world_size != settings.nproc_per_node:
        raise ConfigError(
            f"torchrun started LOCAL_WORLD_SIZE={local_world_size} processes on this node but "
            f"hardware.nproc_per_node={settings.nproc_per_node}: set hardware.nproc_per_node to "
            "torchrun's --nproc_per_node (and hardware.nodes to its --nnodes).")
    if world_size != settings.world_size:
        raise ConfigError(
            f"torchrun started WORLD_SIZE={world_size} processes but hardware.nodes="
            f"{settings.nodes} x hardware.nproc_per_node={settings.nproc_per_node} = "
            f"{settings.world_size}: the world size must be the nodes times the processes per "
            "node. Set hardware.nproc_per_node and hardware.nodes to match torchrun's "
            "--nproc_per_node and --nnodes.")


def check_gpus(settings: DDPSettings, backend: str, device_count: int | None = None) -> None:
    """ConfigError when nccl gets more processes per node than the node has visible GPUs.

    nccl needs one GPU per process; checked from the config alone, so every rank of the node
    fails at once, before any rendezvous.
    """
    count = torch.cuda.device_count() if device_count is None else device_count
    if backend == "nccl" and settings.nproc_per_node > count:
        raise ConfigError(
            f"hardware.nproc_per_node={settings.nproc_per_node} processes per node but only "
            f"{count} CUDA GPU(s) are visible: nccl needs one GPU per process. Set "
            f"hardware.nproc_per_node={count} (and torchrun's --nproc_per_node), or use "
            "hardware.backend=gloo.")


def _select_device(local_rank: int, backend: str, device: str) -> None:
    """Make cuda:LOCAL_RANK the current CUDA device (what `hardware.device=auto|cuda` then uses).

    Required for nccl; with gloo and a CUDA model it spreads the ranks over the GPUs instead of
    stacking them all on cuda:0 (left alone with fewer GPUs than local ranks, or on the CPU)."""
    cuda_model = device in ("auto", "cuda") and torch.cuda.is_available()
    if backend == "nccl" or (cuda_model and local_rank < torch.cuda.device_count()):
        torch.cuda.set_device(local_rank)


def _init_process_group(backend: str, rank: int, world: int, settings: DDPSettings) -> None:
    """init_process_group(env://) with the config's timeout; a rendezvous that does not complete
    (a rank that failed before joining, an unreachable master) becomes a ConfigError."""
    try:
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world, timeout=timedelta(seconds=settings.timeout_s))
    except (RuntimeError, TimeoutError) as error:  # DistStoreError is a RuntimeError
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise ConfigError(
            f"rank {rank} of {world} could not join the process group at {address} within "
            f"hardware.timeout_s={settings.timeout_s:g} s ({' '.join(str(error).split())}). "
            "Another rank probably stopped before joining (see its error), or the nodes cannot "
            "reach MASTER_ADDR:MASTER_PORT (check the rendezvous endpoint and the firewall).") \
            from error


def setup_from_env(settings: DDPSettings, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Join the process group from torchrun's (or SLURM's) environment; returns (rank, world).

    Before any rendezvous (so a failure is the same on every rank): checks the world size
    against the config, selects the backend (`resolve_backend`) and checks the GPUs
    (`check_gpus`). Then selects cuda:LOCAL_RANK and calls init_process_group with the timeout
    hardware.timeout_s, which then bounds every collective too. A no-op (returning the current
    rank and size) when the group already exists.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = launcher_env(env)
    if not under_launcher(env):
        raise ConfigError("hardware=ddp but this process was not started by torchrun (RANK, "
                          "WORLD_SIZE and LOCAL_RANK are not set): run `dptrain hardware=ddp ...` "
                          "(it starts torchrun itself) or `torchrun --nproc_per_node=N -m "
                          "dptrain.cli.main hardware=ddp ...`.")
    rank, world, local = (_launcher_int(env, name) for name in LAUNCHER_ENV)
    local_world = _launcher_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
    check_world_size(world, settings, local_world)
    backend = resolve_backend(settings.backend)
    check_gpus(settings, backend)
    _select_device(local, backend, settings.device)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name in env:
            os.environ[name] = env[name]
    _init_process_group(backend, rank, world, settings)
    quiet_other_ranks(rank)
    return rank, world


def quiet_other_ranks(rank: int) -> None:
    """On a rank other than 0, dptrain's loggers pass warnings and errors only: rank 0 tells the
    run's progress (every process printed its own copy of each epoch line)."""
    if rank != 0:
        logging.getLogger("dptrain").setLevel(logging.WARNING)


def check_not_launched_without_ddp(env: Mapping[str, str] | None = None) -> None:
    """ConfigError when torchrun started several processes but the config is not hardware=ddp:
    each would train the whole job alone and all would write the same run files."""
    env = os.environ if env is None else env
    if all(name in env for name in LAUNCHER_ENV) and env["WORLD_SIZE"] not in ("", "0", "1"):
        raise ConfigError(
            f"torchrun started WORLD_SIZE={env['WORLD_SIZE']} processes but the config is not "
            "hardware=ddp, so each process would train the whole job alone and write the same "
            "run folder. Add hardware=ddp (with hardware.nproc_per_node and hardware.nodes "
            "matching torchrun's --nproc_per_node and --nnodes).")


def join_run(config: Mapping[str, Any], run_dir: Path) -> Path:
    """CLI entry for a resolved config: on hardware=ddp join the group, check the configs,
    silence stdout on ranks other than 0 and return rank 0's run folder (every rank then reads
    and resumes from the same place); otherwise check that torchrun did not start several
    processes (`check_not_launched_without_ddp`) and return `run_dir` unchanged."""
    settings = ddp_settings(config.get("hardware"))
    if settings is None:
        check_not_launched_without_ddp()
        return run_dir
    rank, _ = setup_from_env(settings)
    check_same_config(config)
    if rank != 0:  # one progress bar and summary: rank 0's (errors still go to every stderr)
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    return Path(broadcast_object(str(run_dir)))


def wrap_model(model: torch.nn.Module, config: Mapping[str, Any]) -> torch.nn.Module:
    """DistributedDataParallel(model) on hardware=ddp (rank 0's weights broadcast); on
    hardware=fsdp the model sharded with fully_shard (one unit per `hardware.fsdp_units` class,
    default: per transformer block; dptrain.distributed.fsdp; `hardware.precision=bf16`: FSDP's
    bf16 mixed precision), after broadcasting rank 0's weights; else the model."""
    hardware = config.get("hardware")
    if ddp_settings(hardware) is None:
        return model
    if hardware.get("sharded", False):
        from dptrain.distributed.fsdp import bf16_policy, shard_model

        _broadcast_parameters(model)
        policy = bf16_policy() if hardware.get("precision") == "bf16" else None
        return shard_model(model, list(hardware.get("fsdp_units") or []), mp_policy=policy)
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    device_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _broadcast_parameters(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (as DistributedDataParallel does)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


#: Hydra overrides a relaunched job must not inherit: it runs once (RUN mode) in `run_dir`.
PARENT_ONLY_HYDRA_KEYS = ("hydra.run.", "hydra.sweep.", "hydra.mode", "hydra.launcher",
                          "hydra/launcher", "hydra.sweeper", "hydra/sweeper", "hydra.job.num",
                          "hydra.job.id")
DEFAULT_CONFIG = ("pkg://dptrain.conf", "config")  # the primary config of `dptrain`


def _override_key(override: str) -> str:
    """The key of a Hydra override ("+hydra.job.chdir=true" -> "hydra.job.chdir")."""
    return override.lstrip("+~").split("=", 1)[0]


def relaunch_overrides(overrides: Sequence[str]) -> list[str]:
    """The `overrides` a job run again elsewhere keeps: all but those about where or how the
    parent ran (PARENT_ONLY_HYDRA_KEYS)."""
    return [o for o in overrides if not _override_key(o).startswith(PARENT_ONLY_HYDRA_KEYS)]


def hydra_relaunch_args(hydra: Mapping[str, Any] | None) -> tuple[list[str], str | None]:
    """(Hydra flags and overrides, working directory) that make a child compose the same config.

    `hydra` is the parent job's Hydra config (`HydraConfig.get()`, read as a mapping). The child
    gets the parent's --config-dir / --config-path / --config-name and its hydra.* overrides
    (e.g. hydra.job.chdir, hydra/job_logging), not those about where or how the parent ran
    (PARENT_ONLY_HYDRA_KEYS), and runs in the directory the parent was started from, so that
    relative paths of the command line mean the same. ([], None) without a Hydra config.
    """
    if not hydra:
        return [], None
    args: list[str] = []
    for source in hydra["runtime"]["config_sources"]:
        location = (str(source["path"]) if source["schema"] == "file"
                    else f"{source['schema']}://{source['path']}")
        if source["provider"] == "command-line":
            args.append(f"--config-dir={location}")
        elif source["provider"] == "main" and location != DEFAULT_CONFIG[0]:
            args.append(f"--config-path={location}")
    if hydra["job"]["config_name"] != DEFAULT_CONFIG[1]:
        args.append(f"--config-name={hydra['job']['config_name']}")
    args += relaunch_overrides(hydra["overrides"]["hydra"])
    return args, str(hydra["runtime"]["cwd"])


def torchrun_command(settings: DDPSettings, overrides: Sequence[str], run_dir: Path,
                     hydra_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command line that re-runs this job on `settings.nproc_per_node` processes:
    `hydra_args` (see `hydra_relaunch_args`), the task `overrides`, and hydra.run.dir=run_dir."""
    if settings.nodes != 1:
        raise ConfigError(
            f"hardware.nodes={settings.nodes}: dptrain only starts processes on this machine. "
            "For several machines start torchrun on every node yourself (docs/distributed.md, "
            "multi-node recipe) or use the SLURM launcher (hydra/launcher=slurm).")
    kept = relaunch_overrides(overrides)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={settings.nproc_per_node}", "-m", "dptrain.cli.main",
            *hydra_args, *kept, f"hydra.run.dir={run_dir}"]


def relaunch_with_torchrun(hardware: Mapping[str, Any] | None, overrides: Sequence[str],
                           run_dir: Path, hydra: Mapping[str, Any] | None = None) -> int | None:
    """On hardware=ddp outside torchrun: run the job under torchrun, wait, return its exit code.

    Returns None (nothing done) when the config is not hardware=ddp or this process already is a
    torchrun worker. `overrides` are the job's task overrides and `hydra` the job's Hydra config
    (`HydraConfig.get()`; without it a --config-dir/--config-name or hydra.* override of the
    parent is lost). The workers write into `run_dir` (rank 0 only).
    """
    settings = ddp_settings(hardware)
    if settings is None or under_launcher():
        return None
    hydra_args, cwd = hydra_relaunch_args(hydra)
    command = torchrun_command(settings, overrides, run_dir, hydra_args)
    sys.stdout.flush()
    return subprocess.run(command, check=False, cwd=cwd).returncode
