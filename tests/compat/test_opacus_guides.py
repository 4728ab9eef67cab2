"""Opacus's guide notebooks (tutorials/intro_to_advanced_features.ipynb, guide_to_grad_sampler.ipynb,
guide_to_module_validator.ipynb, vendored in opacus_tutorials/ as their code cells with only their
`opacus` imports changed to `dptrain.opacus`) run cell by cell on dptrain.opacus and on Opacus,
and give the same results: the same per-sample gradients, the same loader lengths, the same
epsilon, the same validation verdicts.

Cells that cannot run as written on either package are named here with what they raise on both
(the guides are partly pseudo-code). Registrations the guides make (a grad sampler for nn.Linear,
validators and fixers for BatchNorm) are undone after each run, so that they reach no other test.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_opacus_examples import _tutorial_cells
from torch import nn

PACKAGES = ("dptrain.opacus", "opacus")


def _run(cell: str, namespace: dict[str, Any], name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(cell, name, "exec"), namespace)  # noqa: S102 (vendored tutorial cell)


# ------------------------------------------------------------------ intro_to_advanced_features

INTRO = "intro_to_advanced_features"
# its cells: 0 data and model, 1 and 11 show figures (img/*.png, not vendored), 2 make_private,
# 3-5 GradSampleModule by hand, 6 forbid_accumulation_hook, 7-8 DPDataLoader, 9 DPOptimizer,
# 10 RDPAccountant attached by a step hook, 12 a Laplace-noise DPOptimizer subclass
FIGURES = (1, 11)
BY_HAND, GRAD_SAMPLES, FORBID_ACCUMULATION = 3, 5, 6


def _run_intro(package: str) -> dict[str, Any]:
    """The guide's cells in order on `package` (seeded: the same data, and from cell 3 on the
    same model and input, on both packages), then one epoch of the loop it builds (its
    DPDataLoader, its hand-built DPOptimizer, its RDPAccountant) with cross-entropy. Returns the
    cells' namespace, with `grads` (cell 5's grad and grad_sample of fc1.weight), `epsilon`
    (delta 1e-5), `steps` and `forbid_error` (what cell 6 raised) added."""
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": f"{INTRO}_on_{package}"}
    for i, cell in enumerate(_tutorial_cells(INTRO, package)):
        if i in FIGURES:
            continue
        if i == BY_HAND:  # make_private (cell 2) may draw from torch's RNG on one package only
            torch.manual_seed(1)
        if i == FORBID_ACCUMULATION:
            with pytest.raises(ImportError) as raised:
                _run(cell, namespace, INTRO)
            namespace["forbid_error"] = str(raised.value)
            continue
        if i == GRAD_SAMPLES:  # read them before its closing model.zero_grad() (Opacus's zeroes
            # the tensors in place, dptrain's drops them)
            cell, closing = cell.rsplit("model.zero_grad()", 1)
            _run(cell, namespace, INTRO)
            namespace["grads"] = {name: namespace[name].clone()
                                  for name in ("grad", "grad_sample", "grad_sample_aggregated")}
            cell = "model.zero_grad()" + closing
        _run(cell, namespace, INTRO)
    model, optimizer = namespace["model"], namespace["optimizer"]
    steps = 0
    for x, y in namespace["data_loader"]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    namespace["steps"] = steps
    namespace["epsilon"] = float(namespace["accountant"].get_epsilon(delta=1e-5))
    return namespace


@pytest.fixture(scope="module")
def intro_runs() -> dict[str, dict[str, Any]]:
    return {package: _run_intro(package) for package in PACKAGES}


def test_intro_hand_built_accountant_reports_opacus_epsilon(intro_runs):
    ours, theirs = intro_runs["dptrain.opacus"], intro_runs["opacus"]
    assert ours["steps"] == theirs["steps"] == 10
    assert theirs["epsilon"] > 0 and ours["epsilon"] == pytest.approx(theirs["epsilon"], rel=1e-3)


def test_intro_make_private_module_is_a_grad_sample_module(intro_runs):
    from dptrain.opacus import GradSampleModule

    # cell 2's objects were replaced by cell 3; make them again as cell 2 did
    namespace = intro_runs["dptrain.opacus"]
    model = namespace["SampleNet"]()
    loader = torch.utils.data.DataLoader(namespace["DATASET"], batch_size=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = namespace["PrivacyEngine"]().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, max_grad_norm=1.0, noise_multiplier=1.0)
    assert isinstance(model, GradSampleModule)


def test_intro_grad_sample_module_gives_opacus_per_sample_gradients(intro_runs):
    ours, theirs = intro_runs["dptrain.opacus"]["grads"], intro_runs["opacus"]["grads"]
    assert ours["grad_sample"].shape == theirs["grad_sample"].shape == (10, 8, 16)
    torch.testing.assert_close(ours["grad"], theirs["grad"])
    torch.testing.assert_close(ours["grad_sample"], theirs["grad_sample"])
    torch.testing.assert_close(ours["grad_sample_aggregated"], ours["grad"], rtol=1e-5, atol=1e-5)


def test_intro_dp_data_loader_keeps_dataset_and_length(intro_runs):
    for package in PACKAGES:
        namespace = intro_runs[package]
        assert namespace["dp_data_loader"].dataset is namespace["DATASET"]
        assert len(namespace["dp_data_loader"]) == 10
        assert len(namespace["batch_sizes"]) == 10


def test_intro_forbid_accumulation_hook_is_not_in_opacus_1_6(intro_runs):
    # the guide imports opacus.privacy_engine.forbid_accumulation_hook, which Opacus 1.6 no
    # longer has; dptrain.opacus mirrors 1.6 (and refuses accumulation at step() instead)
    for package in PACKAGES:
        assert "forbid_accumulation_hook" in intro_runs[package]["forbid_error"]


def _laplace_step(namespace: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step of the guide's LaplaceDPOptimizer (cell 12) over a fresh GradSampleModule of its
    SampleNet on its first 10 examples, seeded: per parameter, the noise the step added
    (p.grad * 10 - p.summed_grad, read in a step hook) and the Laplace draw of the same seed."""
    model = namespace["GradSampleModule"](namespace["SampleNet"]())
    optimizer = namespace["LaplaceDPOptimizer"](
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
        max_grad_norm=1.0, expected_batch_size=10)
    added: list[torch.Tensor] = []
    optimizer.attach_step_hook(lambda o: added.extend(p.grad * 10 - p.summed_grad
                                                      for p in o.params))
    x, y = namespace["DATASET"][:10]
    nn.functional.cross_entropy(model(x), y).backward()
    torch.manual_seed(7)
    optimizer.step()
    torch.manual_seed(7)
    laplace = torch.distributions.laplace.Laplace(loc=0, scale=1.0)
    return [(noise, laplace.sample(noise.shape)) for noise in added]


def test_intro_dp_optimizer_subclass_add_noise_noises_the_step(intro_runs):
    # cell 12's LaplaceDPOptimizer overrides add_noise: its Laplace noise is the step's
    for package in PACKAGES:
        pairs = _laplace_step(intro_runs[package])
        assert len(pairs) == 4
        for noise, draw in pairs:
            torch.testing.assert_close(noise, draw, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ guide_to_grad_sampler

GRAD_SAMPLER = "guide_to_grad_sampler"
# its cells: 0 pseudo-code (a syntax error: `for x, y i DataLoader`), 1 GradSampleModule of
# nn.Linear(42, 2), 2 the Linear grad sampler, 3 the same registered for nn.Linear,
# 4 check_per_sample_gradients_are_correct, with names the guide never defines (N, Z, W) nor
# imports. The guide's sampler takes `activations` as one tensor, as Opacus did before 1.2; Opacus
# 1.6 passes the list of the layer's inputs (so does dptrain), so once registered it raises
# TypeError inside torch.einsum on both.
CHECK_CELL = 4


@contextlib.contextmanager
def _registrations_restored(package: str) -> Iterator[None]:
    """Undo, on exit, what the guides register in `package`'s grad-sampler and validator
    tables."""
    if package == "opacus":
        from opacus.grad_sample import GradSampleModule
        from opacus.validators import ModuleValidator

        tables = [GradSampleModule.GRAD_SAMPLERS]
    else:
        from dptrain.grad_sample import registry
        from dptrain.opacus.validators import ModuleValidator

        registry._ensure_builtin_samplers()
        tables = [registry.GRAD_SAMPLERS]
    tables += [ModuleValidator.VALIDATORS, ModuleValidator.FIXERS]
    saved = [dict(table) for table in tables]
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)


def _run_grad_sampler_guide(package: str) -> dict[str, Any]:
    """The guide's cells 1-4 on `package`, cell 4 given the names it leaves undefined (N, Z, W =
    4, 3, 5; the checker from `package`'s opacus.utils.per_sample_gradients_utils). Returns the
    namespace with `grad_sample` (cell 1's module's per-sample gradients for a seeded input),
    `registered_error` (what cell 4 raised with the guide's sampler registered) and `check_ok`
    (cell 4 run again once the registration is undone)."""
    cells = _tutorial_cells(GRAD_SAMPLER, package)
    with pytest.raises(SyntaxError):
        compile(cells[0], GRAD_SAMPLER, "exec")
    utils = importlib.import_module(f"{package}.utils.per_sample_gradients_utils")
    namespace: dict[str, Any] = {"__name__": f"{GRAD_SAMPLER}_on_{package}", "torch": torch,
                                 "Dict": dict, "N": 4, "Z": 3, "W": 5,
                                 "check_per_sample_gradients_are_correct":
                                     utils.check_per_sample_gradients_are_correct}
    torch.manual_seed(0)
    with _registrations_restored(package):
        _run(cells[1], namespace, GRAD_SAMPLER)
        module = namespace["gs_lin_mod"]
        module(torch.randn(6, 42)).sum().backward()
        namespace["grad_sample"] = {n: p.grad_sample.clone()
                                    for n, p in module._module.named_parameters()}
        for cell in cells[2:CHECK_CELL]:
            _run(cell, namespace, GRAD_SAMPLER)
        with pytest.raises(TypeError) as raised:
            _run(cells[CHECK_CELL], namespace, GRAD_SAMPLER)
        namespace["registered_error"] = raised
    _run(cells[CHECK_CELL], namespace, GRAD_SAMPLER)  # its assert holds
    namespace["check_ok"] = True
    return namespace


@pytest.fixture(scope="module")
def grad_sampler_runs() -> dict[str, dict[str, Any]]:
    return {package: _run_grad_sampler_guide(package) for package in PACKAGES}


def test_grad_sampler_guide_gives_opacus_per_sample_gradients(grad_sampler_runs):
    ours, theirs = grad_sampler_runs["dptrain.opacus"], grad_sampler_runs["opacus"]
    assert ours["grad_sample"]["weight"].shape == (6, 2, 42)
    for name in ("weight", "bias"):
        torch.testing.assert_close(ours["grad_sample"][name], theirs["grad_sample"][name])


def test_grad_sampler_guide_registered_sampler_is_called_with_opacus_arguments(grad_sampler_runs):
    # the guide's sampler, registered for nn.Linear, is what the check's module calls, with the
    # list of inputs Opacus 1.6 passes (the guide's einsum on it fails alike on both)
    for package in PACKAGES:
        raised = grad_sampler_runs[package]["registered_error"]
        assert "got list" in str(raised.value)
        assert any(entry.name == "compute_linear_grad_sample" for entry in raised.traceback)


def test_grad_sampler_guide_correctness_check_passes(grad_sampler_runs):
    # cell 4: check_per_sample_gradients_are_correct(x, nn.Linear(W, W + 2)) with the built-in
    # sampler back in place
    for package in PACKAGES:
        assert grad_sampler_runs[package]["check_ok"]
        assert grad_sampler_runs[package]["model"].in_features == 5


def test_per_sample_gradients_check_finds_wrong_per_sample_gradients():
    from dptrain.grad_sample import registry
    from dptrain.opacus.utils.per_sample_gradients_utils import (
        check_per_sample_gradients_are_correct)

    correct = registry.get_grad_sampler(nn.Linear)
    with _registrations_restored("dptrain.opacus"):
        @registry.register_grad_sampler(nn.Linear)
        def doubled(layer: nn.Linear, activations: Any, backprops: Any) -> Any:
            return {p: 2 * g for p, g in correct(layer, activations, backprops).items()}

        assert not check_per_sample_gradients_are_correct(torch.randn(4, 3, 5), nn.Linear(5, 7))
    assert check_per_sample_gradients_are_correct(torch.randn(4, 3, 5), nn.Linear(5, 7))


def test_grad_sampler_guide_registration_is_undone():
    from dptrain.grad_sample.registry import get_grad_sampler

    sampler = get_grad_sampler(nn.Linear)
    _run_grad_sampler_guide("dptrain.opacus")
    assert get_grad_sampler(nn.Linear) is sampler


# ------------------------------------------------------------------ guide_to_module_validator

VALIDATOR = "guide_to_module_validator"
# its cells: 0 a validator function, 1 registered for BatchNorm (nn used before the guide
# imports it), 2 Opacus's own BatchNorm validator (ShouldReplaceModuleError, never imported,
# and a syntax error: `]. # quite a mouthful`), 3 a fixer registered with register_module_fixer
# (logger never defined), 4 ModuleValidator.is_valid / fix of nn.Linear(2, 1), 5 a "fixer"
# registered by mistake with register_module_validator for BatchNorm2d


def _run_validator_guide(package: str) -> dict[str, Any]:
    """The guide's cells on `package` (nn and logger supplied; cell 2 checked to be the syntax
    error it is on both), then ModuleValidator on models with BatchNorms. Returns the namespace
    with `errors_1d` (validate's errors for a BatchNorm1d), `error_2d` (what validate raises for
    a BatchNorm2d), `fixed` (fix of a model with both) and `fixed_linear_valid`."""
    import logging

    cells = _tutorial_cells(VALIDATOR, package)
    with pytest.raises(SyntaxError):
        compile(cells[2], VALIDATOR, "exec")
    namespace: dict[str, Any] = {"__name__": f"{VALIDATOR}_on_{package}", "nn": nn,
                                 "logger": logging.getLogger(VALIDATOR)}
    with _registrations_restored(package):
        for i, cell in enumerate(cells):
            if i != 2:
                _run(cell, namespace, VALIDATOR)
        validator = namespace["ModuleValidator"]
        namespace["fixed_linear_valid"] = validator.is_valid(namespace["model"])
        namespace["errors_1d"] = validator.validate(nn.Sequential(nn.BatchNorm1d(4)))
        with pytest.raises(TypeError) as raised:
            validator.validate(nn.Sequential(nn.BatchNorm2d(4)))
        namespace["error_2d"] = str(raised.value)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                              nn.Linear(4, 4), nn.BatchNorm1d(4))
        namespace["fixed"] = validator.fix(model)
    return namespace


@pytest.fixture(scope="module")
def validator_runs() -> dict[str, dict[str, Any]]:
    return {package: _run_validator_guide(package) for package in PACKAGES}


def test_validator_guide_registered_validator_reports_its_error(validator_runs):
    # cell 1's validator for BatchNorm1d returns [Exception("BatchNorm is not supported")]
    for package in PACKAGES:
        (error,) = validator_runs[package]["errors_1d"]
        assert str(error) == "BatchNorm is not supported"


def test_validator_guide_last_registration_wins(validator_runs):
    # cell 5 registers fix_batchnorm2d, a fixer, as BatchNorm2d's validator by mistake: validate
    # then gets an InstanceNorm2d where it expects a list of errors, on both packages
    for package in PACKAGES:
        assert validator_runs[package]["error_2d"] == "'InstanceNorm2d' object is not iterable"


def test_validator_guide_registered_fixer_replaces_batchnorm(validator_runs):
    # cell 3's fixer: BatchNorm -> GroupNorm(min(32, C), C)
    for package in PACKAGES:
        fixed = validator_runs[package]["fixed"]
        assert [type(m) for m in fixed] == [nn.Conv2d, nn.GroupNorm, nn.Flatten, nn.Linear,
                                            nn.GroupNorm]
        assert fixed[1].num_groups == 4 and fixed[4].num_groups == 4
        assert validator_runs[package]["fixed_linear_valid"]


def test_validator_guide_registrations_are_undone():
    from dptrain.opacus.validators import ModuleValidator

    validators, fixers = dict(ModuleValidator.VALIDATORS), dict(ModuleValidator.FIXERS)
    _run_validator_guide("dptrain.opacus")
    assert ModuleValidator.VALIDATORS == validators and ModuleValidator.FIXERS == fixers
