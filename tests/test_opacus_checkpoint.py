"""dptrain.opacus.PrivacyEngine.load_checkpoint reads with weights_only=True: a received file's
pickle runs no code unless the caller opts into full unpickling (issue 41, hole 5)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptrain.errors import ConfigError
from dptrain.opacus import PrivacyEngine
from dptrain.opacus.schedulers import StepNoise

N, BATCH = 32, 8


class _Payload:
    """Unpickling this object calls Path.touch on `marker`: the code a crafted checkpoint runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.touch, (self.marker,)


def _private(seed: int = 0) -> tuple[PrivacyEngine, nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the OS-entropy noise note
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=BATCH), noise_multiplier=1.0,
            max_grad_norm=1.0)
    return engine, model, optimizer, loader


def _trained_checkpoint(path: Path) -> tuple[PrivacyEngine, nn.Module, StepNoise]:
    engine, model, optimizer, loader = _private()
    scheduler = StepNoise(optimizer, step_size=1, gamma=0.5)
    for x, y in loader:
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    scheduler.step()
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer,
                           noise_scheduler=scheduler, checkpoint_dict={"epoch": 1})
    return engine, model, scheduler


def test_a_crafted_checkpoint_runs_no_code_when_loaded_by_default(tmp_path):
    marker, path = tmp_path / "payload_ran", tmp_path / "crafted.pt"
    engine, model, _, _ = _private()
    torch.save({"module_state_dict": model.state_dict(),
                "privacy_accountant_state_dict": engine.accountant.state_dict(),
                "evil": _Payload(marker)}, path)
    with pytest.raises(ConfigError, match=r"refused.*weights_only': False"):
        engine.load_checkpoint(path=path, module=model)
    assert not marker.exists()


def test_full_unpickling_stays_an_explicit_opt_in(tmp_path):
    marker, path = tmp_path / "payload_ran", tmp_path / "crafted.pt"
    engine, model, _, _ = _private()
    torch.save({"module_state_dict": model.state_dict(),
                "privacy_accountant_state_dict": engine.accountant.state_dict(),
                "extra": _Payload(marker)}, path)
    rest = engine.load_checkpoint(path=path, module=model,
                                  torch_load_kwargs={"weights_only": False})
    assert marker.exists() and "extra" in rest  # what the opt-in means: the file's code ran


def test_what_save_checkpoint_writes_round_trips_through_load_checkpoint_by_default(tmp_path):
    path = tmp_path / "run.pt"
    saved, model, scheduler = _trained_checkpoint(path)
    engine, fresh, optimizer, _ = _private(seed=1)
    fresh_scheduler = StepNoise(optimizer, step_size=1, gamma=0.5)
    rest = engine.load_checkpoint(path=path, module=fresh, optimizer=optimizer,
                                  noise_scheduler=fresh_scheduler)
    assert rest == {"epoch": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values()))
    assert engine.accountant.state_dict() == saved.accountant.state_dict()
    assert engine.get_epsilon(1e-5) == saved.get_epsilon(1e-5)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
