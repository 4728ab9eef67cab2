"""hydra/launcher=slurm (dptrain/conf/hydra/launcher/slurm.yaml): one SLURM task per DDP process.

The submitit plugin is an optional extra (dptrain[cluster]); without it the file is checked against
the keys of its SlurmQueueConf (hydra-submitit-launcher 1.2), with it against the real dataclass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import dptrain.conf

CONF = Path(dptrain.conf.__file__).parent
#: The fields of hydra_plugins.hydra_submitit_launcher.config.SlurmQueueConf (version 1.2.0).
SLURM_QUEUE_KEYS = {
    "submitit_folder", "timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb",
    "nodes", "name", "stderr_to_stdout", "_target_", "partition", "qos", "comment", "constraint",
    "exclude", "gres", "cpus_per_gpu", "gpus_per_task", "mem_per_gpu", "mem_per_cpu", "account",
    "signal_delay_s", "max_num_timeout", "additional_parameters", "array_parallelism", "setup"}


def _slurm_keys() -> set[str]:
    try:
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    except ImportError:
        return SLURM_QUEUE_KEYS
    return {field.name for field in dataclasses.fields(SlurmQueueConf)}


def _launcher() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / "hydra" / "launcher" / "slurm.yaml"))


def test_the_slurm_launcher_extends_submitits_slurm_config_with_known_keys_only():
    launcher = _launcher()
    assert launcher.pop("defaults") == ["submitit_slurm"]
    assert set(launcher) <= _slurm_keys()


@pytest.mark.parametrize("nodes, per_node", [(1, 2), (3, 4)])
def test_the_slurm_job_has_one_task_and_gpu_per_ddp_process_on_every_node(nodes, per_node):
    launcher = _launcher()
    launcher.pop("defaults")
    hardware = OmegaConf.load(CONF / "hardware" / "ddp.yaml")
    hardware.nodes, hardware.nproc_per_node = nodes, per_node
    config = OmegaConf.create({"hardware": hardware,
                               "hydra": {"sweep": {"dir": "multirun/x"}, "launcher": launcher}})
    resolved = OmegaConf.to_container(config, resolve=True)["hydra"]["launcher"]
    assert (resolved["nodes"], resolved["tasks_per_node"], resolved["gpus_per_node"]) == (
        nodes, per_node, per_node)
