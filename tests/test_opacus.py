"""dptrain.opacus: Opacus-shaped calls run on dptrain and say what they do differently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

opacus = pytest.importorskip("opacus")

from dptrain.errors import PrivacyError  # noqa: E402
from dptrain.opacus import PrivacyEngine  # noqa: E402
from dptrain.opacus.accountants import RDPAccountant  # noqa: E402
from dptrain.opacus.validators import ModuleValidator  # noqa: E402

N, BATCH, STEPS = 64, 8, 3


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=BATCH)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
           criterion: nn.Module | None = None) -> None:
    criterion = criterion or nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()


def _non_poisson(loader: DataLoader, engine: PrivacyEngine | None = None) -> tuple:
    """(engine, model, optimizer, private loader) of make_private(poisson_sampling=False)."""
    model, optimizer, _ = _setup()
    engine = engine or PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return engine, *engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)


def test_poisson_sampling_false_keeps_a_plain_loader_and_charges_it_without_amplification():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    with pytest.warns(UserWarning, match="DataLoader is kept.*WITHOUT amplification"):
        model, optimizer, private = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)
    assert engine.plan.selection.kind == "given_shuffle"
    assert all(torch.equal(mine, theirs) for (mine, _), (theirs, _) in zip(private, loader))
    assert engine.accountant.mechanism() == "shuffle"


def test_poisson_sampling_false_over_a_weighted_sampler_trains_dptrains_shuffle_and_says_why():
    model, optimizer, loader = _setup()
    weighted = DataLoader(loader.dataset, batch_size=BATCH,
                          sampler=torch.utils.data.WeightedRandomSampler([1.0] * N, N))
    engine = PrivacyEngine(accountant="rdp")
    with pytest.warns(UserWarning, match="WeightedRandomSampler.*own shuffle.*WITHOUT"):
        model, optimizer, private = engine.make_private(
            module=model, optimizer=optimizer, data_loader=weighted, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)
    assert engine.plan.selection.kind == "shuffle"
    _train(model, optimizer, private)
    assert engine.get_epsilon(1e-5) > 0 and engine.accountant.mechanism() == "shuffle"


def test_the_shuffle_accountant_names_a_mechanism_no_poisson_accountant_has():
    engine, model, optimizer, loader = _non_poisson(_setup()[2])
    _train(model, optimizer, loader)
    state = engine.accountant.state_dict()
    assert set(state) == {"history", "mechanism"} and state["mechanism"] == "shuffle"
    assert "shuffle" not in ("rdp", "prv", "gdp") and state["history"] == [(1.0, BATCH / N, 3)]


def test_a_shuffle_run_checkpoint_round_trips_through_save_and_load_checkpoint(tmp_path):
    engine, model, optimizer, loader = _non_poisson(_setup()[2])
    for x, y in loader:  # one whole pass: a checkpoint resumes at a pass boundary
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        optimizer.step()
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model)
    restored, model, _, _ = _non_poisson(_setup()[2])
    restored.load_checkpoint(path=tmp_path / "run.pt", module=model)
    saved = torch.load(tmp_path / "run.pt", weights_only=False)["privacy_accountant_state_dict"]
    assert saved["mechanism"] == "shuffle"  # Opacus's accountant state, marked as a shuffle's
    assert restored.accountant.state_dict() == engine.accountant.state_dict()
    assert restored.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_a_shuffle_history_and_a_poisson_one_are_refused_by_each_others_accountant(tmp_path):
    shuffled, model, optimizer, loader = _non_poisson(_setup()[2])
    _train(model, optimizer, loader)
    shuffled.save_checkpoint(path=tmp_path / "run.pt", module=model)
    poisson = PrivacyEngine(accountant="rdp")
    poisson.accountant.step(noise_multiplier=1.0, sample_rate=BATCH / N)
    with pytest.raises(PrivacyError, match="charged shuffled batches.*charges Poisson"):
        poisson.load_checkpoint(path=tmp_path / "run.pt", module=model)
    with pytest.raises(PrivacyError, match="charged Poisson.*charges shuffled batches"):
        shuffled.accountant.load_state_dict(poisson.accountant.state_dict())
    assert len(poisson.accountant) == 1 and len(shuffled.accountant) == STEPS


def test_ghost_mode_returns_opacus_four_values_and_its_criterion_trains():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
        max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")
    _train(model, optimizer, loader, criterion)
    assert len(engine.accountant) == STEPS


def test_functorch_mode_runs_as_hooks_with_a_warning():
    model, optimizer, loader = _setup()
    with pytest.warns(UserWarning, match="runs as 'hooks'"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                     noise_multiplier=1.0, max_grad_norm=1.0,
                                     grad_sample_mode="functorch")


def test_accountant_has_opacus_mechanism_and_state_dict_keys():
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    assert accountant.mechanism() == "rdp"
    assert set(accountant.state_dict()) == {"history", "mechanism"}


def test_validator_takes_strict_and_fix_takes_num_groups():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    assert ModuleValidator.validate(model, strict=False)
    fixed = ModuleValidator.fix(model, num_groups=4)
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 4
    assert ModuleValidator.validate(fixed, strict=True) == []


def test_the_same_run_under_opacus_and_dptrain_opacus_reports_the_same_epsilon():
    epsilons = []
    for engine_class in (opacus.PrivacyEngine, PrivacyEngine):
        model, optimizer, loader = _setup()
        engine = engine_class(accountant="rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, loader = engine.make_private(
                module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1,
                max_grad_norm=1.0)
            _train(model, optimizer, loader)
            epsilons.append(engine.get_epsilon(1e-5))
    assert epsilons[1] == pytest.approx(epsilons[0], rel=1e-3)


def test_hand_built_optimizer_loader_and_accountant_hook_account_every_step():
    from dptrain.opacus.data_loader import DPDataLoader
    from dptrain.opacus.grad_sample import GradSampleModule
    from dptrain.opacus.optimizers import DPOptimizer

    model, optimizer, loader = _setup()
    model = GradSampleModule(model)
    optimizer = DPOptimizer(optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=BATCH, generator=torch.Generator().manual_seed(0))
    loader = DPDataLoader.from_data_loader(loader, distributed=False)
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=BATCH / N))
    _train(model, optimizer, loader)
    assert len(accountant) == STEPS and accountant.get_epsilon(1e-5) > 0


def test_noise_from_os_entropy_is_announced_and_a_generator_silences_it():
    model, optimizer, loader = _setup()
    with pytest.warns(UserWarning, match="OS entropy"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    model, optimizer, loader = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                     noise_multiplier=1.0, max_grad_norm=1.0,
                                     noise_generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("accountant", "length"), [("rdp", {"epochs": 3}), ("rdp", {"steps": 40}),
                                                    ("gdp", {"epochs": 3}), ("prv", {"steps": 40})])
def test_get_noise_multiplier_returns_opacus_sigma(accountant, length):
    from opacus.accountants.utils import get_noise_multiplier as opacus_sigma

    from dptrain.opacus.accountants.utils import get_noise_multiplier

    arguments = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.05,
                     accountant=accountant, **length)
    assert get_noise_multiplier(**arguments) == opacus_sigma(**arguments)


def test_make_private_with_epsilon_uses_opacus_sigma_and_reaches_its_epsilon():
    from opacus import PrivacyEngine as OpacusEngine

    sigmas, epsilons = [], []
    for engine_class in (OpacusEngine, PrivacyEngine):
        model, optimizer, loader = _setup()
        engine = engine_class(accountant="rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, dp_optimizer, private_loader = engine.make_private_with_epsilon(
                module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0,
                target_delta=1e-5, epochs=2, max_grad_norm=1.0)
        sigmas.append(dp_optimizer.noise_multiplier)
        for _ in range(2 * len(loader)):
            engine.accountant.step(noise_multiplier=sigmas[-1], sample_rate=BATCH / N)
        epsilons.append(engine.get_epsilon(1e-5))
    assert sigmas[1] == sigmas[0]
    assert epsilons[1] == pytest.approx(epsilons[0], rel=1e-9)


def test_an_optimizer_of_other_parameters_is_refused_with_opacus_words():
    model, _, loader = _setup()
    optimizer = torch.optim.SGD(ModuleValidator.fix(model).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Module parameters are different than optimizer "
                                         "Parameters.*model.parameters"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                     noise_multiplier=1.0, max_grad_norm=1.0)


def test_fix_logs_each_replacement_as_opacus_does(caplog):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    with caplog.at_level("INFO"):
        ModuleValidator.fix(model)
    assert [r.getMessage().split(" :")[0] for r in caplog.records] == ["Replaced sub_module 1"]


def test_the_adapter_imports_no_private_name_of_the_core():
    import ast
    import pathlib

    import dptrain.opacus

    private = []
    for path in pathlib.Path(dptrain.opacus.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dptrain")
                    and not node.module.startswith("dptrain.opacus")):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert private == []


def test_batch_memory_manager_length_counts_physical_batches_as_opacus_does():
    from dptrain.opacus.utils.batch_memory_manager import BatchMemoryManager

    model, optimizer, loader = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, dp_optimizer, private_loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0)
    with BatchMemoryManager(data_loader=private_loader, max_physical_batch_size=BATCH // 2,
                            optimizer=dp_optimizer) as physical:
        assert len(physical) == 2 * len(private_loader)


def test_make_functional_computes_the_module_with_the_given_parameters():
    from dptrain.opacus.grad_sample.functorch import make_functional

    model, _, _ = _setup()
    fmodel, params = make_functional(model)
    x = torch.randn(3, 4)
    assert torch.equal(fmodel(params, x), model(x))
    doubled = tuple(2 * p for p in params)
    assert not torch.allclose(fmodel(doubled, x), model(x))
