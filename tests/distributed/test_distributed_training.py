"""DP-SGD on 2 gloo ranks (forked) against the same run on one process.

All scenarios run once, under one process group (module fixture); each test checks one behaviour.
The single-process references use the same engine seed, hence the same global Poisson batches and
the same noise stream: the DDP run must reproduce them up to float64 summation order.
"""

from __future__ import annotations

import math

import pytest
import torch

import ddp_workers as workers

ATOL = 1e-12


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    results = workers.run_ranks(workers.scenarios_worker, tmp_path_factory.mktemp("ranks"))
    for result in results:
        assert "crash" not in result, result.get("crash")
    return results


@pytest.fixture(scope="module")
def single() -> dict:
    return {name: workers.train_private(False, **kwargs)
            for name, kwargs in workers.SCENARIOS.items() if name != "noise_std"}


def _assert_same_model(ranks, single, scenario):
    for result in ranks:
        torch.testing.assert_close(result[scenario]["params"], single[scenario]["params"],
                                   rtol=0, atol=ATOL)


def test_with_noise_0_the_ddp_model_equals_the_single_process_model(ranks, single):
    _assert_same_model(ranks, single, "hooks_noise0")


def test_the_union_of_the_ranks_batches_is_the_single_process_global_batch(ranks, single):
    unions = [sorted(a + b) for a, b in zip(ranks[0]["hooks_noise0"]["batches"],
                                           ranks[1]["hooks_noise0"]["batches"])]
    assert unions == single["hooks_noise0"]["batches"]


def test_ghost_clipping_with_virtual_batches_equals_the_single_process_run(ranks, single):
    _assert_same_model(ranks, single, "ghost_virtual_noise0")


def test_with_noise_on_ranks_hold_identical_models_equal_to_the_seeded_single_run(ranks, single):
    assert torch.equal(ranks[0]["hooks_noise"]["params"], ranks[1]["hooks_noise"]["params"])
    _assert_same_model(ranks, single, "hooks_noise")


def test_virtual_batches_with_noise_add_the_noise_once_per_logical_batch(ranks, single):
    _assert_same_model(ranks, single, "hooks_virtual_noise")


def test_banded_noise_is_drawn_and_correlated_once_as_in_the_seeded_single_run(ranks, single):
    assert torch.equal(ranks[0]["banded_virtual_noise"]["params"],
                       ranks[1]["banded_virtual_noise"]["params"])
    _assert_same_model(ranks, single, "banded_virtual_noise")
    assert not torch.allclose(single["banded_virtual_noise"]["params"],
                              single["hooks_virtual_noise"]["params"])


def test_adaptive_clipping_keeps_the_same_bound_on_every_rank(ranks, single):
    bounds = [r["adaptive_noise"]["bound"] for r in ranks]
    assert bounds[0] == bounds[1] == pytest.approx(single["adaptive_noise"]["bound"], abs=ATOL)
    _assert_same_model(ranks, single, "adaptive_noise")


def test_per_layer_clipping_equals_the_single_process_run(ranks, single):
    _assert_same_model(ranks, single, "per_layer_noise")


def test_steps_with_an_empty_shard_on_one_rank_equal_the_single_process_run(ranks, single):
    assert any(not batch for batch in ranks[1]["empty_shards_noise"]["batches"])
    _assert_same_model(ranks, single, "empty_shards_noise")


def test_the_accountant_history_of_a_ddp_run_equals_the_single_process_one(ranks, single):
    for result in ranks:
        assert result["hooks_noise"]["history"] == single["hooks_noise"]["history"]


def test_the_added_noise_has_the_std_of_one_draw_of_sigma_c_not_sqrt_world_times(ranks):
    noise = ranks[0]["noise_std"]["noise"]            # [40 steps, 83 coordinates]
    expected = 1.0 * ranks[0]["noise_std"]["bound"]   # sigma * C
    std = noise.std().item()
    # 3320 draws: the relative standard error of the std is ~1/sqrt(2 * 3320) = 1.2%.
    assert abs(std / expected - 1) < 0.06
    assert abs(std / (expected * math.sqrt(2)) - 1) > 0.2


def test_every_rank_sees_the_same_noise(ranks):
    assert torch.equal(ranks[0]["noise_std"]["noise"], ranks[1]["noise_std"]["noise"])
