"""Private training of FSDP2-sharded models (fully_shard) on 2 gloo ranks against one process.

The scenarios run once per group, under one process group (module fixtures); each test checks one
behaviour. The single-process references use the same engine seed, hence the same global Poisson
batches: with sigma = 0 the sharded run must reproduce them up to float64 summation order.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddp_workers
import fsdp_workers as workers

ATOL = 1e-12

MLP = {
    "hooks": dict(problem=workers.mlp_problem, steps=5, noise_multiplier=0.0),
    "ghost_first_layer_a_unit": dict(problem=workers.mlp_problem, steps=5, noise_multiplier=0.0,
                                     grad_sample_mode="ghost", units=workers.first_layer),
    "noise": dict(problem=workers.mlp_problem, steps=40, noise_multiplier=1.0, lr=0.0),
    "virtual_batches": dict(problem=workers.mlp_problem, steps=5, noise_multiplier=0.0,
                            physical=2, grad_sample_mode="ghost"),
    # q = 1/40: each rank's shard of 20 examples is empty in ~60% of the steps.
    "empty_shards": dict(problem=workers.mlp_problem, steps=12, noise_multiplier=0.0, batch=1,
                         physical=1),
    "per_layer": dict(problem=workers.mlp_problem, steps=5, noise_multiplier=0.0,
                      clipping="per_layer", units=workers.first_layer),
    "adaptive": dict(problem=workers.mlp_problem, steps=5, noise_multiplier=1.0,
                     clipping="adaptive", count_noise_std=2.0),
    "bf16": dict(problem=workers.mlp_float32_problem, steps=5, noise_multiplier=0.0,
                 mixed_precision=True, grad_sample_mode="ghost", units=workers.first_layer),
}
HF = {
    "gpt2_hooks": dict(problem=workers.gpt2_problem, steps=3, noise_multiplier=0.0,
                       units=workers.gpt2_blocks),
    "gpt2_ghost": dict(problem=workers.gpt2_problem, steps=3, noise_multiplier=0.0,
                       units=workers.gpt2_blocks, grad_sample_mode="ghost"),
    "bert_lora_hooks": dict(problem=workers.bert_lora_problem, steps=3, noise_multiplier=0.0,
                            units=workers.bert_layers, lr=20.0),
    "bert_lora_ghost": dict(problem=workers.bert_lora_problem, steps=3, noise_multiplier=0.0,
                            units=workers.bert_layers, grad_sample_mode="ghost", lr=20.0),
    # q = 1/20, one row per chunk: a rank's shard of 20 sequences is often empty, and the ranks'
    # chunk counts differ (padding passes on the rank with fewer).
    "gpt2_empty_shards_hooks": dict(problem=workers.gpt2_problem, steps=4, noise_multiplier=0.0,
                                    units=workers.gpt2_blocks, batch=2, physical=1),
    "gpt2_empty_shards_ghost": dict(problem=workers.gpt2_problem, steps=4, noise_multiplier=0.0,
                                    units=workers.gpt2_blocks, batch=2, physical=1,
                                    grad_sample_mode="ghost"),
    # no noise at all (gradient or count): the bound follows the unclipped counts alone.
    "gpt2_adaptive_empty_shards": dict(problem=workers.gpt2_problem, steps=4,
                                       noise_multiplier=0.0, units=workers.gpt2_blocks, batch=2,
                                       physical=1, clipping="adaptive", count_noise_std=0.0,
                                       max_grad_norm=0.05),
}


def _run(scenarios: dict, folder) -> list[dict]:
    results = ddp_workers.run_ranks(workers.scenarios_worker, folder, args=(scenarios,),
                                    timeout_s=240)
    for result in results:
        assert "crash" not in result, result.get("crash")
    return results


@pytest.fixture(scope="module")
def mlp_ranks(tmp_path_factory) -> list[dict]:
    return _run(MLP, tmp_path_factory.mktemp("mlp"))


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory) -> list[dict]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return _run(HF, tmp_path_factory.mktemp("hf"))


def _single(scenarios: dict, name: str) -> dict:
    return workers.train_private(sharded=False, **scenarios[name])


def _assert_same_model(ranks: list[dict], single: dict, scenario: str, atol: float = ATOL) -> None:
    for result in ranks:
        torch.testing.assert_close(result[scenario]["params"], single["params"], rtol=0, atol=atol)


def test_with_noise_0_the_sharded_mlp_equals_the_single_process_mlp_in_hooks_mode(mlp_ranks):
    _assert_same_model(mlp_ranks, _single(MLP, "hooks"), "hooks")


def test_with_noise_0_the_sharded_mlp_equals_the_single_process_mlp_in_ghost_mode(mlp_ranks):
    _assert_same_model(mlp_ranks, _single(MLP, "ghost_first_layer_a_unit"),
                       "ghost_first_layer_a_unit")


@pytest.mark.parametrize("scenario", ["gpt2_hooks", "gpt2_ghost"])
def test_with_noise_0_a_sharded_gpt2_with_tied_embeddings_equals_one_process(hf_ranks, scenario):
    single = _single(HF, scenario)
    initial = workers.full_parameters(workers.gpt2_problem()[0])
    assert (single["params"] - initial).abs().max() > 1e-3  # the steps moved the weights
    _assert_same_model(hf_ranks, single, scenario)


@pytest.mark.parametrize("scenario", ["bert_lora_hooks", "bert_lora_ghost"])
def test_with_noise_0_a_sharded_bert_with_lora_equals_one_process(hf_ranks, scenario):
    single = _single(HF, scenario)
    initial = workers.full_parameters(workers.bert_lora_problem()[0])
    assert (single["params"] - initial).abs().max() > 1e-3
    _assert_same_model(hf_ranks, single, scenario)


def _has_padding_passes(ranks: list[dict], scenario: str) -> bool:
    """Whether a rank ran a padding pass while the other ran a real one (its shard empty, or
    fewer chunks than the other's): the ranks' passes are in step, one chunk each at a time."""
    first, second = (r[scenario]["chunk_sizes"] for r in ranks)
    return any((a == 0) != (b == 0) for a, b in zip(first, second))


@pytest.mark.parametrize("scenario", ["gpt2_empty_shards_hooks", "gpt2_empty_shards_ghost"])
def test_a_sharded_gpt2_whose_shard_is_empty_on_some_steps_equals_one_process(hf_ranks, scenario):
    assert _has_padding_passes(hf_ranks, scenario)
    single = _single(HF, scenario)
    initial = workers.full_parameters(workers.gpt2_problem()[0])
    assert (single["params"] - initial).abs().max() > 1e-4  # the steps moved the weights
    _assert_same_model(hf_ranks, single, scenario)


def test_padding_passes_leave_adaptive_clippings_unclipped_count_as_on_one_process(hf_ranks):
    scenario = "gpt2_adaptive_empty_shards"
    assert _has_padding_passes(hf_ranks, scenario)
    single = _single(HF, scenario)
    assert single["bound"] != 0.05  # the counts moved the bound
    for result in hf_ranks:
        assert result[scenario]["counts"] == single["counts"]
        assert result[scenario]["bound"] == pytest.approx(single["bound"], rel=1e-12)


@pytest.fixture(scope="module")
def classifier_norms(tmp_path_factory) -> list[dict]:
    ranks = ddp_workers.run_ranks(workers.classifier_norms_worker,
                                  tmp_path_factory.mktemp("norms"), timeout_s=240)
    for rank in ranks:
        assert "crash" not in rank, rank.get("crash")
    return ranks


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("kind", workers.CLASSIFIERS)
def test_every_parameters_per_example_norm_of_a_sharded_transformer_is_the_single_process_one(
        classifier_norms, kind, mode):
    """The clipping bound rests on these norms. BERT's and RoBERTa's layers end in a LayerNorm
    whose output is the FSDP unit's output: its hooks must run after FSDP has gathered the unit
    (they ran before: hooks mode refused the model, ghost mode counted 0 for those parameters,
    so every example's norm was too small and its clipped gradient could exceed C)."""
    from dptrain.grad_sample.ghost import GhostClippingModule
    from dptrain.grad_sample.module import GradSampleModule

    model = workers.tiny_classifier(kind)
    wrapper = GradSampleModule if mode == "hooks" else GhostClippingModule
    expected = workers.squared_norms_of_one_batch(wrapper(model), model)
    for rank in classifier_norms:
        norms = rank["norms"][f"{kind}/{mode}"]
        assert isinstance(norms, dict), norms  # else the error the sharded run raised
        assert norms.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(norms[name], value, rtol=1e-9, atol=1e-15, msg=name)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("kind", workers.CLASSIFIERS + ("in_place",))
def test_no_fsdp_unit_returns_a_view_so_torch_does_not_warn_of_wrong_gradients(
        classifier_norms, kind, mode):
    """The per-sample hooks once handed each layer's caller a view of its output, so that FSDP's
    pre-backward hook ran first; a unit ending in a hooked layer (BERT's LayerNorm, the MLP's
    Linear) then returned a view and torch warned, on every forward, that "backward [may] fail
    or produce wrong gradients". They now run after FSDP's hooks without any view."""
    for rank in classifier_norms:
        assert rank["view_warnings"][f"{kind}/{mode}"] == []


def _micro_batch_squared_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: Tensor[4]}: each example's squared gradient norm, from its own backward (float64)."""
    x, y = workers.InPlaceAfterUnit.batch()
    norms: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for b in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[b:b + 1]), y[b:b + 1]).backward()
        for name, p in model.named_parameters():
            norms[name].append(p.grad.pow(2).sum())
    return {n: torch.stack(v) for n, v in norms.items()}


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_an_in_place_op_on_a_units_output_keeps_the_per_example_norms_exact(classifier_norms, mode):
    """`h = unit(x); h.mul_(2)`: with the old view, the in-place op dropped FSDP's pre-backward
    hook (backward then read the unit's released parameters: "setStorage ... out of bounds");
    every per-example norm must equal the micro-batch one in float64."""
    expected = _micro_batch_squared_norms(workers.InPlaceAfterUnit())
    for rank in classifier_norms:
        norms = rank["norms"][f"in_place/{mode}"]
        assert isinstance(norms, dict), norms  # else the error the sharded run raised
        assert norms.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(norms[name], value, rtol=1e-9, atol=1e-15, msg=name)


def test_with_one_rank_an_empty_batch_runs_no_padding_pass(tmp_path):
    (result,) = ddp_workers.run_ranks(workers.one_rank_worker, tmp_path, world_size=1,
                                      timeout_s=120)
    assert "crash" not in result, result.get("crash")
    steps = result["steps"]
    assert any(step["batch"] == 0 for step in steps) and result["steps_taken"] == len(steps)
    for step in steps:
        assert step["passes"] == ([step["batch"]] if step["batch"] else [])


def test_virtual_batches_of_different_counts_per_rank_equal_the_single_process_run(mlp_ranks):
    _assert_same_model(mlp_ranks, _single(MLP, "virtual_batches"), "virtual_batches")


def test_steps_with_an_empty_shard_on_one_rank_equal_the_single_process_run(mlp_ranks):
    assert any(size == 0 for r in mlp_ranks for size in r["empty_shards"]["chunk_sizes"])
    _assert_same_model(mlp_ranks, _single(MLP, "empty_shards"), "empty_shards")


def test_per_layer_clipping_of_a_sharded_model_equals_the_single_process_run(mlp_ranks):
    _assert_same_model(mlp_ranks, _single(MLP, "per_layer"), "per_layer")


def test_adaptive_clipping_keeps_the_same_bound_on_every_rank(mlp_ranks):
    bounds = [r["adaptive"]["bound"] for r in mlp_ranks]
    assert bounds[0] == bounds[1] != 0.3  # it moved from the initial bound, equally


def test_each_element_gets_noise_of_std_sigma_c_over_b_once_per_step(mlp_ranks):
    rows = [r["noise"]["noise"] for r in mlp_ranks]       # [40 steps, this rank's elements]
    noise = torch.cat(rows, dim=1)                          # every element once: 83 per step
    assert noise.shape == (40, 83)
    result = mlp_ranks[0]["noise"]
    expected = 1.0 * result["bound"] / result["expected_batch_size"]   # sigma * C / B
    # 3320 draws: the relative standard error of the std is ~1/sqrt(2 * 3320) = 1.2%.
    assert abs(noise.std().item() / expected - 1) < 0.06
    assert abs(noise.std().item() / (expected * math.sqrt(2)) - 1) > 0.2
    assert bool((noise != 0).all())                          # no element skipped


def test_the_ranks_draw_independent_noise_for_their_rows(mlp_ranks):
    first, second = (r["noise"]["noise"] for r in mlp_ranks)
    width = min(first.shape[1], second.shape[1])
    a, b = first[:, :width].flatten(), second[:, :width].flatten()
    correlation = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(correlation) < 4 / math.sqrt(a.numel())       # 4 standard errors
    assert not torch.equal(first[:, :width], second[:, :width])


def test_the_accountant_of_a_sharded_run_equals_the_single_process_one(mlp_ranks):
    single = _single(MLP, "noise")
    for result in mlp_ranks:
        assert result["noise"]["history"] == single["history"]
        assert result["noise"]["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)


def test_bf16_mixed_precision_keeps_the_clipped_sums_in_float32(mlp_ranks):
    for result in mlp_ranks:
        assert result["bf16"]["sum_dtypes"] == ["torch.float32"]


def test_bf16_mixed_precision_trains_like_float32_up_to_bf16_rounding(mlp_ranks):
    single = workers.train_private(sharded=False, **{**MLP["bf16"], "mixed_precision": False})
    _assert_same_model(mlp_ranks, single, "bf16", atol=2e-2)


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> list[dict]:
    return _run_worker(workers.errors_worker, tmp_path_factory.mktemp("errors"))


def _run_worker(worker, folder) -> list[dict]:
    results = ddp_workers.run_ranks(worker, folder, timeout_s=120)
    for result in results:
        assert "crash" not in result, result.get("crash")
    return results


def test_examples_run_before_a_padding_pass_is_cleared_are_refused(errors):
    for result in errors:
        assert "per-sample gradients of a padding pass" in result["padding_then_examples"]
        assert "optimizer.step()" in result["padding_then_examples"]


def test_a_trainable_parameter_fsdp_does_not_manage_is_refused_naming_it(errors):
    for result in errors:
        assert "'2.weight' is not sharded by FSDP" in result["root_left_whole"]
        assert "fully_shard to the root module" in result["root_left_whole"]


def test_a_sharded_model_without_poisson_sampling_is_refused(errors):
    for result in errors:
        assert "fully sharded (FSDP)" in result["non_poisson"]


def test_user_level_privacy_with_a_sharded_model_is_refused(errors):
    for result in errors:
        assert "fully sharded (FSDP) model (hardware=ddp, hardware=fsdp)" in result["user_level"]


def test_fsdp_units_naming_a_class_the_model_lacks_are_refused_naming_the_key(errors):
    for result in errors:
        assert "hardware.fsdp_units=['GPT2Block']" in result["missing_unit"]


def test_a_model_sharded_the_default_way_is_accepted(errors):
    assert [r["sharded_fine"] for r in errors] == [None, None]
