"""Opacus scripts that needed more than the import changed (issue 40, item 11), checked against
Opacus 1.6 itself as the oracle: a batch larger than the dataset, isinstance against Opacus's
optimizer classes, every public module path of Opacus, and the refusal of gradient accumulation
over Poisson batches at the second backward()."""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

opacus = pytest.importorskip("opacus")

import dptrain.opacus  # noqa: E402
from dptrain.errors import ConfigError, PrivacyError  # noqa: E402

# a dataset smaller than the batch (Opacus's char-LSTM and CIFAR-10 examples on a small sample)
N, BATCH = 32, 100


def _loader(n: int = N, batch: int = BATCH) -> DataLoader:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,))),
                      batch_size=batch)


def _private(engine: object, loader: DataLoader, model: nn.Module | None = None,
             **kwargs: object) -> tuple:
    model = model if model is not None else nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make = (engine.make_private_with_epsilon if "target_epsilon" in kwargs
                else engine.make_private)
        kwargs.setdefault("max_grad_norm", 1.0)
        return make(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    data_loader=loader, **kwargs)


def _train(model: nn.Module, optimizer: object, loader: DataLoader, epochs: int = 1) -> None:
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


# -- a. a batch larger than the dataset ------------------------------------------------------
def test_a_batch_larger_than_the_dataset_runs_at_opacus_q_of_one_and_is_charged_so():
    ours = dptrain.opacus.PrivacyEngine(accountant="rdp")
    theirs = opacus.PrivacyEngine(accountant="rdp")
    results = []
    for engine in (ours, theirs):
        model, optimizer, loader = _private(engine, _loader(), noise_multiplier=1.0)
        assert len(loader) == 1
        _train(model, optimizer, loader, epochs=2)
        results.append((loader.sample_rate, optimizer.expected_batch_size,
                        [tuple(map(float, h)) for h in engine.accountant.history],
                        engine.get_epsilon(1e-5)))
    (q, batch, history, epsilon), (q_o, batch_o, history_o, epsilon_o) = results
    assert q == q_o == 1.0
    assert batch == batch_o == N
    assert history == history_o == [(1.0, 1.0, 2)]
    assert epsilon == pytest.approx(epsilon_o, rel=1e-6)


def test_a_batch_larger_than_the_dataset_calibrates_sigma_at_opacus_q_of_one():
    sigmas = []
    for engine in (dptrain.opacus.PrivacyEngine(accountant="rdp"),
                   opacus.PrivacyEngine(accountant="rdp")):
        _, optimizer, _ = _private(engine, _loader(), target_epsilon=8.0, target_delta=1e-5,
                                   epochs=3)
        sigmas.append(optimizer.noise_multiplier)
    assert sigmas[0] == pytest.approx(sigmas[1], rel=1e-9)


def test_the_engines_own_make_private_still_refuses_a_batch_larger_than_the_dataset():
    with pytest.raises(PrivacyError, match="sample rate of 3.125"):
        _private(dptrain.PrivacyEngine(), _loader(), noise_multiplier=1.0)


# -- b. isinstance against Opacus's optimizer classes ------------------------------------------
def test_isinstance_of_opacus_optimizer_classes_holds_for_what_make_private_returns():
    from dptrain.opacus import optimizers as o
    from dptrain.opacus.optimizers.optimizer import DPOptimizer

    def made(**kwargs: object) -> object:
        return _private(dptrain.opacus.PrivacyEngine(), _loader(64, 16), noise_multiplier=1.0,
                        **kwargs)[1]

    flat, per_layer = made(), made(clipping="per_layer", max_grad_norm=[1.0, 1.0])
    adaptive, ghost = made(clipping="adaptive"), made(grad_sample_mode="ghost")
    for optimizer in (flat, per_layer, adaptive, ghost):
        assert isinstance(optimizer, o.DPOptimizer)
        assert isinstance(optimizer, DPOptimizer)
        assert not isinstance(optimizer, (o.DistributedDPOptimizer, o.DistributedPerLayerOptimizer,
                                          o.FSDPOptimizerFastGradientClipping))
    assert isinstance(per_layer, o.DPPerLayerOptimizer)
    assert isinstance(adaptive, o.AdaClipDPOptimizer)
    assert isinstance(ghost, o.DPOptimizerFastGradientClipping)
    assert not isinstance(flat, (o.DPPerLayerOptimizer, o.AdaClipDPOptimizer,
                                 o.DPOptimizerFastGradientClipping))
    assert not isinstance(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), o.DPOptimizer)
    assert o.get_optimizer_class("per_layer", False) is o.DPPerLayerOptimizer


def test_a_hand_built_per_layer_optimizer_clips_each_parameter_to_its_own_bound():
    from dptrain.opacus.grad_sample import GradSampleModule
    from dptrain.opacus.optimizers import DPOptimizer, DPPerLayerOptimizer

    torch.manual_seed(0)
    model = GradSampleModule(nn.Linear(4, 1))
    optimizer = DPPerLayerOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                    noise_multiplier=0.0, max_grad_norm=[1e-3, 1e-3],
                                    expected_batch_size=8)
    x = torch.randn(8, 4) * 100
    model(x).sum().backward()
    optimizer.step()
    assert isinstance(optimizer, DPOptimizer)
    for p in model.parameters():  # 8 per-sample gradients, each clipped to 1e-3, over 8
        assert p.grad.norm() <= 1e-3 * (1 + 1e-6)


def test_opacus_optimizer_classes_that_dptrain_builds_itself_refuse_a_direct_build():
    from dptrain.opacus.optimizers import AdaClipDPOptimizer

    with pytest.raises(ConfigError, match='clipping="adaptive"'):
        AdaClipDPOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


# -- c. every public module path of Opacus 1.6 -------------------------------------------------
def _opacus_paths() -> list[str]:
    """Opacus's public module paths (no `_` part, no opacus.tests), walked from its package."""
    paths = []
    for info in pkgutil.walk_packages(opacus.__path__, "opacus.",
                                      onerror=lambda name: None):
        parts = info.name.split(".")
        if parts[1] != "tests" and not any(p.startswith("_") for p in parts):
            paths.append(info.name)
    return paths


def _ours(path: str) -> str:
    return "dptrain.opacus" + path[len("opacus"):]


def test_every_public_module_path_of_opacus_imports_from_dptrain_opacus():
    paths = _opacus_paths()
    assert len(paths) > 60  # the walk saw Opacus's package
    missing = []
    for path in paths:
        try:
            importlib.import_module(_ours(path))
        except ImportError as error:
            missing.append(f"{path}: {error}")
    assert missing == []


# the modules migrating scripts import most: every public name of Opacus's is there
MOST_USED = ["opacus", "opacus.privacy_engine", "opacus.optimizers", "opacus.optimizers.optimizer",
             "opacus.grad_sample", "opacus.grad_sample.utils", "opacus.layers",
             "opacus.layers.dp_rnn", "opacus.layers.dp_multihead_attention", "opacus.accountants",
             "opacus.accountants.utils", "opacus.accountants.analysis.rdp",
             "opacus.accountants.analysis.gdp", "opacus.schedulers", "opacus.validators",
             "opacus.utils.batch_memory_manager", "opacus.utils.packed_sequences",
             "opacus.utils.tensor_utils", "opacus.utils.fast_gradient_clipping_utils",
             "opacus.utils.adaptive_clipping", "opacus.utils.module_utils",
             "opacus.utils.uniform_sampler", "opacus.data_loader", "opacus.distributed"]


def _public_names(module: object) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__ and callable(v)]


@pytest.mark.parametrize("path", MOST_USED)
def test_the_most_used_opacus_modules_expose_every_public_name(path: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = importlib.import_module(path)
    ours = importlib.import_module(_ours(path))
    assert [n for n in _public_names(theirs) if not hasattr(ours, n)] == []


def test_opacus_names_without_a_counterpart_import_and_raise_one_clear_error_when_used():
    from dptrain.opacus.grad_sample.gsm_no_op import GradSampleModuleNoOp
    from dptrain.opacus.lightning import DPLightningDataModule
    from dptrain.opacus.utils.tensor_utils import unfold2d

    for name, stand_in in (("gsm_no_op.GradSampleModuleNoOp", GradSampleModuleNoOp),
                           ("lightning.DPLightningDataModule", DPLightningDataModule),
                           ("tensor_utils.unfold2d", unfold2d)):
        with pytest.raises(ConfigError, match=f"{name} has no counterpart .* Use instead: "):
            stand_in(nn.Linear(2, 2))


def test_compute_seq_lengths_gives_opacus_lengths_of_a_packed_sequence():
    from opacus.utils.packed_sequences import compute_seq_lengths as theirs

    from dptrain.opacus.utils.packed_sequences import _gen_packed_data, compute_seq_lengths

    torch.manual_seed(0)
    for batch_first in (True, False):
        for sorted_ in (True, False):
            packed = _gen_packed_data(9, 6, 3, batch_first, sorted_)
            assert compute_seq_lengths(packed.batch_sizes) == theirs(packed.batch_sizes)
    assert compute_seq_lengths(torch.tensor([4])) == [1, 1, 1, 1]


def test_rdp_and_gdp_analysis_functions_give_opacus_values():
    from opacus.accountants.analysis import gdp as their_gdp
    from opacus.accountants.analysis import rdp as their_rdp

    from dptrain.opacus.accountants.analysis import gdp, rdp

    orders = [1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    ours = rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=1000, orders=orders)
    theirs = their_rdp.compute_rdp(q=0.01, noise_multiplier=1.1, steps=1000, orders=orders)
    assert ours == pytest.approx(theirs, rel=1e-8)
    eps, order = rdp.get_privacy_spent(orders=orders, rdp=ours, delta=1e-5)
    eps_o, order_o = their_rdp.get_privacy_spent(orders=orders, rdp=theirs, delta=1e-5)
    assert (eps, order) == (pytest.approx(eps_o, rel=1e-9), order_o)
    args = dict(steps=1000, noise_multiplier=1.1, sample_rate=0.01)
    assert gdp.compute_eps_poisson(**args, delta=1e-5) == pytest.approx(
        their_gdp.compute_eps_poisson(**args, delta=1e-5), rel=1e-9)


# -- d. gradient accumulation over Poisson batches: refused at the second backward() -----------
def test_a_backward_over_a_second_poisson_batch_without_zero_grad_raises_at_backward():
    model, optimizer, loader = _private(dptrain.opacus.PrivacyEngine(), _loader(256, 32),
                                        noise_multiplier=1.0)
    batches = iter(loader)
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()
    x, y = next(batches)  # a new Poisson batch, the first one's gradients still pending
    loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match="refused at backward"):  # Opacus's type; a PrivacyError
        loss.backward()
    with pytest.raises(PrivacyError):  # nor can the step release the two batches
        optimizer.step()
    # zero_grad() lifts the refusal: the loop goes on with one batch a step
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        break
    assert optimizer.steps_taken == 1


def test_zero_grad_after_drawing_the_next_batch_keeps_backward_allowed():
    model, optimizer, loader = _private(dptrain.opacus.PrivacyEngine(), _loader(256, 32),
                                        noise_multiplier=1.0)
    batches = iter(loader)
    x, y = next(batches)
    nn.functional.cross_entropy(model(x), y).backward()  # a batch left without a step
    x, y = next(batches)
    optimizer.zero_grad()  # its gradients dropped before the next backward: allowed
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert optimizer.steps_taken == 1


def test_importing_every_module_path_first_leaves_the_accountants_working():
    """A submodule once imported becomes an attribute of its package: Opacus's
    accountants.rdp shadowed the engine's rdp module inside dptrain.opacus.accountants."""
    for path in _opacus_paths():
        importlib.import_module(_ours(path))
    from dptrain.opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    assert 0 < accountant.get_epsilon(1e-5, alphas=[2, 4, 8]) < float("inf")
