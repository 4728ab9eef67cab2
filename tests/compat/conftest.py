"""Opacus 1.6's own public-API tests, ported to dptrain.opacus by changing imports only.

LEFT_OUT lists the ported tests that do not pass on dptrain, each with its reason (also in
docs/migrating-from-opacus.md); they are deselected, neither run nor counted as passed.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("opacus", reason="the compatibility tests compare against opacus>=1.5")

# Why a ported test is left out, one reason per kind (each was checked by running the test)
PRV_NUMERICS = (
    "asserts Opacus's PRV epsilon to 7 places: dptrain's PRV accountant (its own discretisation "
    "of the privacy loss distribution) gives 6.77835 where Opacus gives 6.77740, 1.4e-4 apart "
    "relatively, inside the eps_error=0.01 that both guarantee")
GLOBAL_SEED = (
    "expects torch.manual_seed to repeat the run: dptrain.opacus draws the noise and the "
    "Poisson / shuffle sampling from OS entropy, not torch's global RNG (reproducible only on "
    "request: noise_generator=, or dptrain.PrivacyEngine(seed=..., reproducible_mechanism=True))")
LOADER_GENERATOR = (
    "expects the Poisson sampling to follow the generator of the original DataLoader "
    "(DataLoader(generator=g)): dptrain's Poisson sampler does not take it (it draws from OS "
    "entropy unless dptrain.PrivacyEngine(seed=..., reproducible_mechanism=True)), so the two "
    "runs see different batches")
SWITCH_GENERATOR = (
    "tests opacus.data_loader.switch_generator, an Opacus helper that dptrain.opacus does not "
    "provide (dptrain's loaders take their generator when built)")
COLLATE_INTERNALS = (
    "tests CollateFnWithEmpty / wrap_collate_with_empty, internals of Opacus's DPDataLoader "
    "collation that dptrain.opacus does not provide (dptrain's loader builds empty batches itself)")
OPACUS_DRAWS = (
    "expects Opacus's Poisson draws for generator seed 0 (a non-empty first batch): dptrain's "
    "sampler draws its own sequence from the same seed, whose first batch is empty")
EMPTY_FIRST_BATCH_LOG = (
    "expects Opacus's Poisson draws for generator seed 0 (an empty first batch) and its warning "
    "'First batch is empty' on the logger opacus.data_loader: dptrain draws its own sequence "
    "and logs nothing there")
GRAD_SAMPLE_LIST = (
    "expects p.grad_sample after 8 backward passes to be a list of 8 tensors: dptrain's "
    "GradSampleModule keeps one tensor of all the passes' rows")
ACCUMULATED_ITERATIONS = (
    "accumulates 8 batches into one step (Opacus's optimizer.accumulated_iterations / "
    "grad_samples): dptrain refuses a step that releases several batches of the private loader "
    "(use BatchMemoryManager to split one logical batch)")
NO_ZERO_GRAD_NEEDED = (
    "expects a loop without optimizer.zero_grad() to raise: dptrain's step frees the per-sample "
    "gradients and overwrites p.grad, so each step uses its own batch only and the loop trains "
    "correctly")
FROZEN_BATCHNORM = (
    "expects a BatchNorm without trainable parameters to be valid: dptrain refuses every "
    "BatchNorm, frozen too (its running statistics are computed from private data and saved "
    "without noise)")
SUMMED_GRAD_AFTER_STEP = (
    "reads p.summed_grad after optimizer.step(): dptrain clears the noise-free clipped sum at "
    "the end of the step (left on the parameters, torch.save(model) would release it); Opacus "
    "keeps it until zero_grad()")
GRAD_SAMPLE_AFTER_STEP = (
    "reads p.grad_sample after optimizer.step(): dptrain frees the per-sample gradients once "
    "they are clipped into the sum")
SEQUENCE_FIRST = (
    "makes the sequence-first SampleAttnNet private with batch_first=True "
    "(make_private_with_epsilon's default): Opacus then takes the sequence dimension for the "
    "batch; dptrain refuses (ConfigError naming the DPMultiheadAttention with batch_first=False)")
NOISE_TOLERANCE = (
    "asserts the squared norm of fresh noise within 15 % of its mean, which for a small model is "
    "a few standard deviations of its chi-square (1.35 for the custom-layer model's 160 "
    "parameters, 3.3 for the tied-weights model's 972, 3.5 for the attention model's 1,097): "
    "over hypothesis's draws it fails now and then with dptrain's fresh noise (seen: tied "
    "weights, 0.1073 off where 0.1068 is allowed), while Opacus passes with the noise of "
    "torch.manual_seed(100). The ConvNet models (13,042 parameters, 15 % is 12 standard "
    "deviations) keep the check; measured noise variance per step: 0.98 of sigma^2 C^2 / B^2")

# test id (file::Class::test) -> why it is left out
LEFT_OUT: dict[str, str] = {
    "test_opacus_accountants.py::AccountingTest::test_prv_accountant":
        PRV_NUMERICS,
    "test_opacus_batch_memory_manager.py::BatchMemoryManagerTest::test_equivalent_to_one_batch":
        GLOBAL_SEED,
    "test_opacus_batch_memory_manager.py::BatchMemoryManagerTestWithExpandedWeights::test_equivalent_to_one_batch":
        GLOBAL_SEED,
    "test_opacus_batch_memory_manager.py::BatchMemoryManagerTestWithFunctorch::test_equivalent_to_one_batch":
        GLOBAL_SEED,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_batch_first_false":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_dict_structure_preserved":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_empty_batch_before_first_returns_zero_tensors":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_empty_first_batch_shapes_match_dataset":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_empty_first_batch_then_normal_batches":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_empty_first_batch_without_shapes_returns_empty_list":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_multiple_empty_batches":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_nested_list_structure":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_no_collator_fn":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_rand_on_empty_true":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_simple_tensor_empty_batch":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_simple_tensor_non_empty":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_tuple_preservation":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_unsupported_type_raises_error":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::CollateFnWithEmptyTest::test_wrap_collate_with_empty_function":
        COLLATE_INTERNALS,
    "test_opacus_dpdataloader.py::DPDataLoaderEmptyFirstBatchTest::test_empty_first_batch_with_dp_dataloader":
        EMPTY_FIRST_BATCH_LOG,
    "test_opacus_dpdataloader.py::DPDataLoaderTest::test_collate_classes":
        OPACUS_DRAWS,
    "test_opacus_dpdataloader.py::DPDataLoaderTest::test_collate_tensor":
        OPACUS_DRAWS,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTest::test_grad_sample_accumulation":
        GRAD_SAMPLE_LIST,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTest::test_privacy_engine_no_poisson_accumulation":
        ACCUMULATED_ITERATIONS,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTest::test_privacy_engine_zero_grad":
        NO_ZERO_GRAD_NEEDED,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTestFunctorch::test_grad_sample_accumulation":
        GRAD_SAMPLE_LIST,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTestFunctorch::test_privacy_engine_no_poisson_accumulation":
        ACCUMULATED_ITERATIONS,
    "test_opacus_gradient_accumulation.py::GradientAccumulationTestFunctorch::test_privacy_engine_zero_grad":
        NO_ZERO_GRAD_NEEDED,
    "test_opacus_module_validator.py::ModuleValidator_test::test_is_valid_non_learnable_bn":
        FROZEN_BATCHNORM,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenHooksTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenHooksTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenHooksTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTestFunctorch::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTestFunctorch::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetFrozenTestFunctorch::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetHooksTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetHooksTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetHooksTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTestExpandedWeights::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTestExpandedWeights::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTestFunctorch::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTestFunctorch::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineConvNetTestFunctorch::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerHooksTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerHooksTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerHooksTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerHooksTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineCustomLayerTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextHooksTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTextHooksTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextHooksTest::test_make_private_with_epsilon":
        SEQUENCE_FIRST,
    "test_opacus_privacy_engine.py::PrivacyEngineTextHooksTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTest::test_make_private_with_epsilon":
        SEQUENCE_FIRST,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTestFunctorch::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTestFunctorch::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTestFunctorch::test_make_private_with_epsilon":
        SEQUENCE_FIRST,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTestFunctorch::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsHooksTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsHooksTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsHooksTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTest::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTest::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTest::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTestFunctorch::test_deterministic_run":
        GLOBAL_SEED,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTestFunctorch::test_flat_clipping":
        SUMMED_GRAD_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTestFunctorch::test_sample_grad_aggregation":
        GRAD_SAMPLE_AFTER_STEP,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineTextHooksTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineTextTestFunctorch::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsHooksTest::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_privacy_engine.py::PrivacyEngineTiedWeightsTestFunctorch::test_noise_level":
        NOISE_TOLERANCE,
    "test_opacus_randomness.py::DataLoaderRandomnessTest::test_global_seed":
        GLOBAL_SEED,
    "test_opacus_randomness.py::DataLoaderRandomnessTest::test_original_generator":
        LOADER_GENERATOR,
    "test_opacus_randomness.py::DataLoaderSwitchRandomnessTest::test_basic_switch":
        SWITCH_GENERATOR,
    "test_opacus_randomness.py::DataLoaderSwitchRandomnessTest::test_raise_sequential":
        SWITCH_GENERATOR,
    "test_opacus_randomness.py::DataLoaderSwitchRandomnessTest::test_switch_same_seed":
        SWITCH_GENERATOR,
    "test_opacus_randomness.py::OptimizerRandomnessTest::test_global_seed":
        GLOBAL_SEED,
    "test_opacus_randomness.py::PrivacyEngineSecureModeTest::test_custom_and_global_seed":
        LOADER_GENERATOR,
    "test_opacus_randomness.py::PrivacyEngineSecureModeTest::test_dl_seed_no_noise":
        LOADER_GENERATOR,
    "test_opacus_randomness.py::PrivacyEngineSecureModeTest::test_global_seed":
        GLOBAL_SEED,
    "test_opacus_randomness.py::PrivacyEngineSecureModeTest::test_seed":
        LOADER_GENERATOR,
}


# files whose ported tests together take over ~20 s on 1 CPU core: marked slow
SLOW_FILES = ("test_opacus_accountants.py", "test_opacus_dp_layers_dp_rnn.py",
              "test_opacus_privacy_engine.py", "test_opacus_gradient_accumulation.py",
              "test_opacus_randomness.py")


# single tests over ~20 s (hypothesis draws many examples) in files that are otherwise fast
SLOW_TESTS = ("test_opacus_batch_memory_manager.py::BatchMemoryManagerTest::test_basic",
              "test_opacus_batch_memory_manager.py::BatchMemoryManagerTestWithExpandedWeights::"
              "test_basic",
              "test_opacus_batch_memory_manager.py::BatchMemoryManagerTestWithFunctorch::test_basic")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES or item.nodeid.split("compat/", 1)[-1] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("DPTRAIN_COMPAT_RUN_LEFT_OUT"):
        return  # diagnosing: run the left-out tests too
    left_out = [item for item in items if item.nodeid.split("compat/", 1)[-1] in LEFT_OUT]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
