"""dptrain.opacus: Opacus-shaped calls run on dptrain and say what they do differently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

opacus = pytest.importorskip("opacus")

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


def test_a_shuffled_loader_is_accounted_without_amplification_and_says_so():
    model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp")
    with pytest.warns(UserWarning, match="WITHOUT amplification"):
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False)
    assert engine.plan.selection.kind == "shuffle"
    _train(model, optimizer, loader)
    assert engine.get_epsilon(1e-5) > 0


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
