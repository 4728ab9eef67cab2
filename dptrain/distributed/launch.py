"""`hardware=ddp`: start (or join) the torchrun processes, the process group, and check configs.

Two ways in, same result:

* The user starts the processes: `torchrun --nproc_per_node=2 -m dptrain.cli.main hardware=ddp
  ...` (multi-node: the same on every node with --nnodes/--node_rank/--rdzv_endpoint, see the
  README section "Distributed training"). Each process reads RANK / WORLD_SIZE / LOCAL_RANK.
* `dptrain hardware=ddp hardware.nproc_per_node=2 ...` without torchrun: the process re-launches
  itself through `python -m torch.distributed.run --standalone` with the same overrides and its
  own run folder (`hydra.run.dir`), waits, and exits with torchrun's status.

Every rank then joins the process group (gloo on CPU, nccl on CUDA; `hardware.backend`) with a
timeout (`hardware.timeout_s`) on every collective, so no rank can hang forever, and checks that
its resolved config hashes equal rank 0's. All checks that can fail on one rank only are made
before the first collective, or are collective themselves (every rank sees the same outcome).
"""

from __future__ import annotations

import hashlib
import json
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

from dptrain.distributed.runtime import all_gather_objects, broadcast_object
from dptrain.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")
#: Environment variables torchrun sets in every worker (their presence means "already launched").
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
MAX_LISTED_KEYS = 5


@dataclass(frozen=True)
class DDPSettings:
    """The `hardware` group of `hardware=ddp`, checked.

    Attributes:
        nproc_per_node: processes per machine (one per GPU; on CPU, processes sharing the cores).
        nodes: machines; world size = nodes * nproc_per_node.
        backend: "auto" (nccl when CUDA is available, else gloo), "gloo" or "nccl".
        timeout_s: seconds any rendezvous or collective may wait before every rank fails.
    """

    nproc_per_node: int
    nodes: int = 1
    backend: str = "auto"
    timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


def _positive_int(hardware: Mapping[str, Any], key: str, default: int) -> int:
    value = hardware.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"hardware.{key}={value!r} must be an integer >= 1.")
    return value


def ddp_settings(hardware: Mapping[str, Any] | None) -> DDPSettings | None:
    """DDPSettings when `hardware.distributed` is true (hardware=ddp), else None."""
    if not hardware or not hardware.get("distributed", False):
        return None
    backend = str(hardware.get("backend", "auto"))
    if backend not in BACKENDS:
        raise ConfigError(f"hardware.backend={backend!r} is not a torch.distributed backend "
                          f"dptrain supports: use one of {list(BACKENDS)} (auto: nccl on CUDA, "
                          "gloo on CPU).")
    timeout = hardware.get("timeout_s", 300.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"hardware.timeout_s={timeout!r} must be a number of seconds > 0.")
    return DDPSettings(nproc_per_node=_positive_int(hardware, "nproc_per_node", 1),
                       nodes=_positive_int(hardware, "nodes", 1), backend=backend,
                       timeout_s=float(timeout))


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
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfigError(f"cannot find the master host of SLURM_JOB_NODELIST={nodelist!r} "
                          f"({error}): export MASTER_ADDR (the first node's host name) in the "
                          "job's setup (hydra.launcher.setup).") from error
    return out[0]


def launcher_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT of this process.

    torchrun's variables when set; otherwise SLURM's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID; MASTER_ADDR from the node list unless exported; MASTER_PORT 29500 unless
    exported).
    """
    env = dict(os.environ if env is None else env)
    if all(name in env for name in LAUNCHER_ENV) or _slurm_tasks(env) <= 1:
        return env
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_PORT", "29500")
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
                          "start dptrain with torchrun (see the README section 'Distributed "
                          "training'), which sets RANK, WORLD_SIZE and LOCAL_RANK.") from error


def check_world_size(world_size: int, settings: DDPSettings) -> None:
    """ConfigError unless WORLD_SIZE == hardware.nodes * hardware.nproc_per_node."""
    if world_size != settings.world_size:
        raise ConfigError(
            f"torchrun started WORLD_SIZE={world_size} processes but hardware.nodes="
            f"{settings.nodes} x hardware.nproc_per_node={settings.nproc_per_node} = "
            f"{settings.world_size}: the world size must be the nodes times the processes per "
            "node. Set hardware.nproc_per_node and hardware.nodes to match torchrun's "
            "--nproc_per_node and --nnodes.")


def setup_from_env(settings: DDPSettings, env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Join the process group from torchrun's environment; returns (rank, world_size).

    Selects the backend (`resolve_backend`), checks the world size against the config, sets the
    CUDA device to LOCAL_RANK for nccl and calls init_process_group(timeout=hardware.timeout_s).
    A no-op (returning the current rank and size) when the group already exists.
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
    check_world_size(world, settings)
    backend = resolve_backend(settings.backend)
    if backend == "nccl":
        torch.cuda.set_device(local)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name in env:
            os.environ[name] = env[name]
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=settings.timeout_s))
    return rank, world


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of a resolved config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<missing>") != fb.get(k, "<missing>"))


def check_same_config(config: Mapping[str, Any], group: Any = None) -> None:
    """ConfigError on EVERY rank unless every rank's resolved config equals rank 0's.

    One all_gather of (digest, config); the message names the ranks and the differing keys.
    """
    gathered = all_gather_objects((config_digest(config), dict(config)), group=group)
    reference_digest, reference = gathered[0]
    bad = [(rank, cfg) for rank, (digest, cfg) in enumerate(gathered) if digest != reference_digest]
    if not bad:
        return
    keys = sorted({k for _, cfg in bad for k in _differing_keys(reference, cfg)})
    shown = ", ".join(keys[:MAX_LISTED_KEYS]) + (", ..." if len(keys) > MAX_LISTED_KEYS else "")
    raise ConfigError(
        f"the config of rank(s) {[rank for rank, _ in bad]} differs from rank 0's in {shown}: "
        "every process of a hardware=ddp run must get the same overrides (same command line and "
        "config files on every node). Nothing was trained.")


def join_run(config: Mapping[str, Any], run_dir: Path) -> Path:
    """CLI entry for a resolved config: on hardware=ddp join the group, check the configs,
    silence stdout on ranks other than 0 and return rank 0's run folder (every rank then reads
    and resumes from the same place); otherwise return `run_dir` unchanged."""
    settings = ddp_settings(config.get("hardware"))
    if settings is None:
        return run_dir
    rank, _ = setup_from_env(settings)
    check_same_config(config)
    if rank != 0:  # one progress bar and summary: rank 0's (errors still go to every stderr)
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    return Path(broadcast_object(str(run_dir)))


def wrap_model(model: torch.nn.Module, config: Mapping[str, Any]) -> torch.nn.Module:
    """DistributedDataParallel(model) on hardware=ddp (rank 0's weights broadcast), else model."""
    if ddp_settings(config.get("hardware")) is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    device_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def torchrun_command(settings: DDPSettings, overrides: Sequence[str], run_dir: Path) -> list[str]:
    """The torchrun command line that re-runs this job on `settings.nproc_per_node` processes."""
    if settings.nodes != 1:
        raise ConfigError(
            f"hardware.nodes={settings.nodes}: dptrain only starts processes on this machine. "
            "For several machines start torchrun on every node yourself (README: 'Distributed "
            "training', multi-node recipe) or use the SLURM launcher (hydra/launcher=slurm).")
    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra.run.dir=")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={settings.nproc_per_node}", "-m", "dptrain.cli.main",
            *kept, f"hydra.run.dir={run_dir}"]


def relaunch_with_torchrun(hardware: Mapping[str, Any] | None, overrides: Sequence[str],
                           run_dir: Path) -> int | None:
    """On hardware=ddp outside torchrun: run the job under torchrun, wait, return its exit code.

    Returns None (nothing done) when the config is not hardware=ddp or this process already is a
    torchrun worker. The workers write into `run_dir` (rank 0 only).
    """
    settings = ddp_settings(hardware)
    if settings is None or under_launcher():
        return None
    command = torchrun_command(settings, overrides, run_dir)
    sys.stdout.flush()
    return subprocess.run(command, check=False).returncode
