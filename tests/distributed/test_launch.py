"""hardware=ddp glue: settings, backend choice, torchrun command, and clear errors on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ddp_workers as workers
from dptrain.distributed.launch import (
    DDPSettings,
    ddp_settings,
    launcher_env,
    resolve_backend,
    setup_from_env,
    torchrun_command,
    under_launcher,
)
from dptrain.errors import ConfigError

DDP = {"distributed": True, "nproc_per_node": 2, "nodes": 1, "backend": "auto", "timeout_s": 60}


@pytest.fixture(scope="module")
def rank_errors(tmp_path_factory) -> list[dict]:
    results = workers.run_ranks(workers.errors_worker, tmp_path_factory.mktemp("errors"))
    for result in results:
        assert "crash" not in result, result.get("crash")
    return results


def test_a_hardware_group_without_distributed_is_not_ddp():
    assert ddp_settings({"device": "cpu"}) is None


def test_ddp_settings_give_the_world_size_of_nodes_times_processes():
    assert ddp_settings({**DDP, "nodes": 3}).world_size == 6


@pytest.mark.parametrize("key, value", [("nproc_per_node", 0), ("nodes", 1.5),
                                        ("backend", "mpi"), ("timeout_s", 0)])
def test_a_bad_hardware_value_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"hardware.{key}"):
        ddp_settings({**DDP, key: value})


def test_auto_backend_is_gloo_without_cuda():
    assert resolve_backend("auto", cuda=False) == "gloo"


def test_nccl_without_cuda_is_a_config_error_that_suggests_gloo():
    with pytest.raises(ConfigError, match="hardware.backend=gloo"):
        resolve_backend("nccl", cuda=False)


def test_outside_torchrun_joining_the_group_is_a_config_error_naming_torchrun():
    with pytest.raises(ConfigError, match="torchrun"):
        setup_from_env(DDPSettings(2), env={})


def test_the_relaunch_command_reruns_the_same_overrides_in_the_same_run_folder(tmp_path: Path):
    command = torchrun_command(DDPSettings(2), ["hardware=ddp", "train.epochs=1"], tmp_path)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in command
    assert command[-3:] == ["hardware=ddp", "train.epochs=1", f"hydra.run.dir={tmp_path}"]


def test_relaunching_on_several_nodes_is_a_config_error_pointing_to_the_recipe(tmp_path: Path):
    with pytest.raises(ConfigError, match="Distributed training"):
        torchrun_command(DDPSettings(2, nodes=2), [], tmp_path)


def test_torchrun_variables_mean_already_launched():
    assert under_launcher({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not under_launcher({})


def test_a_multi_task_slurm_step_is_read_as_a_launch():
    env = launcher_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                        "MASTER_ADDR": "node1"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == (
        "3", "4", "1", "29500")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl is available on this machine")
def test_an_unavailable_backend_fails_on_every_rank_without_hanging(rank_errors):
    assert all("hardware.backend" in r["nccl"] for r in rank_errors)


def test_a_world_size_other_than_nodes_times_processes_fails_on_every_rank(rank_errors):
    assert all("WORLD_SIZE=2" in r["world"] and "hardware.nproc_per_node" in r["world"]
               for r in rank_errors)


def test_mismatched_configs_fail_on_every_rank_naming_the_key(rank_errors):
    assert all("train.epochs" in r["config"] and "rank(s) [1]" in r["config"] for r in rank_errors)


def test_identical_configs_pass_the_check(rank_errors):
    assert [r["same_config"] for r in rank_errors] == [None, None]


def test_a_ddp_model_without_poisson_sampling_is_refused_on_every_rank(rank_errors):
    assert all("poisson_sampling=True" in r["non_poisson"] for r in rank_errors)
