"""hardware=ddp glue: settings, backend choice, torchrun command, and clear errors on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import ddp_workers as workers
from dptrain.distributed.launch import (
    MASTER_PORT_BASE,
    DDPSettings,
    check_gpus,
    check_world_size,
    check_not_launched_without_ddp,
    ddp_settings,
    hydra_relaunch_args,
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


def test_only_rank_0_logs_the_runs_progress_and_every_rank_its_warnings(rank_errors):
    """Each epoch line once, not once per process."""
    assert [r["logs_progress"] for r in rank_errors] == [True, False]
    assert [r["logs_warnings"] for r in rank_errors] == [True, True]


#: A parent job's Hydra config as HydraConfig.get() holds it (the keys hydra_relaunch_args reads).
PARENT_HYDRA = {
    "runtime": {"cwd": "/home/me/project", "config_sources": [
        {"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
        {"path": "dptrain.conf", "schema": "pkg", "provider": "main"},
        {"path": "/home/me/project/myconf", "schema": "file", "provider": "command-line"},
        {"path": "", "schema": "structured", "provider": "schema"}]},
    "job": {"config_name": "config"},
    "overrides": {"hydra": ["hydra.sweep.dir=multirun/x", "hydra.mode=MULTIRUN",
                            "hydra/launcher=joblib", "hydra.job.chdir=true"],
                  "task": ["+recipe=mine", "hardware=ddp"]},
}


def test_a_hardware_group_without_distributed_is_not_ddp():
    assert ddp_settings({"device": "cpu"}) is None


def test_ddp_settings_give_the_world_size_of_nodes_times_processes():
    assert ddp_settings({**DDP, "nodes": 3}).world_size == 6


@pytest.mark.parametrize("key, value", [("nproc_per_node", 0), ("nodes", 1.5),
                                        ("backend", "mpi"), ("timeout_s", 0),
                                        ("device", "cuda:1")])
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
    with pytest.raises(ConfigError, match="docs/distributed.md, multi-node recipe"):
        torchrun_command(DDPSettings(2, nodes=2), [], tmp_path)


def test_torchrun_variables_mean_already_launched():
    assert under_launcher({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not under_launcher({})


def test_a_multi_task_slurm_step_is_read_as_a_launch():
    env = launcher_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                        "MASTER_ADDR": "node1"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == (
        "3", "4", "1", "node1")


def test_a_slurm_jobs_master_port_comes_from_its_job_id_so_jobs_sharing_a_node_differ():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "node1"}
    ports = {launcher_env({**slurm, "SLURM_JOB_ID": job})["MASTER_PORT"] for job in ("17", "18")}
    assert ports == {str(MASTER_PORT_BASE + 17), str(MASTER_PORT_BASE + 18)}


def test_an_exported_master_port_wins_over_the_slurm_job_id():
    env = launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "node1",
                        "SLURM_JOB_ID": "17", "MASTER_PORT": "12345"})
    assert env["MASTER_PORT"] == "12345"


def test_torchruns_processes_per_node_must_equal_nproc_per_node_even_if_the_world_size_matches():
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=4 .* hardware.nproc_per_node=2"):
        check_world_size(8, DDPSettings(2, nodes=4), local_world_size=4)


def test_nccl_with_more_processes_per_node_than_gpus_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="hardware.nproc_per_node=4 .* only 2 CUDA GPU"):
        check_gpus(DDPSettings(4), "nccl", device_count=2)


def test_gloo_may_run_more_processes_than_gpus():
    check_gpus(DDPSettings(4), "gloo", device_count=0)


def test_several_torchrun_processes_without_hardware_ddp_is_a_config_error():
    with pytest.raises(ConfigError, match="Add hardware=ddp"):
        check_not_launched_without_ddp({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_one_torchrun_process_or_none_is_fine_without_hardware_ddp():
    check_not_launched_without_ddp({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    check_not_launched_without_ddp({})


def test_the_relaunched_job_keeps_the_parents_config_dir_and_its_own_hydra_overrides():
    args, cwd = hydra_relaunch_args(PARENT_HYDRA)
    assert args == ["--config-dir=/home/me/project/myconf", "hydra.job.chdir=true"]
    assert cwd == "/home/me/project"


def test_the_relaunched_job_keeps_a_custom_primary_config_and_config_path():
    parent = {**PARENT_HYDRA, "job": {"config_name": "mine"}}
    parent["runtime"] = {"cwd": "/w", "config_sources": [
        {"path": "/w/conf", "schema": "file", "provider": "main"}]}
    args, _ = hydra_relaunch_args(parent)
    assert args[:2] == ["--config-path=/w/conf", "--config-name=mine"]


def test_the_relaunch_command_puts_the_hydra_flags_before_the_overrides(tmp_path: Path):
    command = torchrun_command(DDPSettings(2), ["+recipe=mine"], tmp_path,
                               hydra_args=["--config-dir=/c"])
    assert command[-3:] == ["--config-dir=/c", "+recipe=mine", f"hydra.run.dir={tmp_path}"]


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


def test_a_node_local_dataset_root_may_differ_across_ranks(rank_errors):
    assert [r["node_local_root"] for r in rank_errors] == [None, None]


def test_a_rank_passing_its_own_shard_as_the_dataset_fails_on_every_rank(rank_errors):
    assert all("num_samples" in r["shard_as_dataset"] and "WHOLE dataset" in r["shard_as_dataset"]
               for r in rank_errors)


def test_a_rank_with_another_clipping_norm_fails_on_every_rank(rank_errors):
    assert all("max_grad_norm" in r["clipping_norm"] and "rank(s) [1]" in r["clipping_norm"]
               for r in rank_errors)


def test_ranks_with_the_same_make_private_arguments_pass_the_checks(rank_errors):
    assert [r["same_arguments"] for r in rank_errors] == [None, None]


def test_a_rank_that_never_joins_stops_the_others_after_the_timeout_naming_it(tmp_path: Path):
    rank0, _ = workers.run_ranks(workers.missing_rank_worker, tmp_path, timeout_s=30)
    assert "crash" not in rank0, rank0.get("crash")
    assert "hardware.timeout_s=1" in rank0["error"] and "could not join" in rank0["error"]
    assert rank0["waited_s"] < 15


def test_a_ddp_model_without_poisson_sampling_is_refused_on_every_rank(rank_errors):
    assert all("poisson_sampling=True" in r["non_poisson"] for r in rank_errors)
