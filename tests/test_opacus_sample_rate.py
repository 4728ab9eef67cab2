"""dptrain.opacus samples Poisson batches at Opacus's q, 1 / len(data_loader), so that a dataset
whose size is not a multiple of the batch size gets Opacus's expected batch, steps and epsilon
(dptrain's own engine takes batch_size / N)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

opacus = pytest.importorskip("opacus")

from dptrain.opacus import PrivacyEngine  # noqa: E402

# 42 examples in batches of 16: len(loader) = 3, so Opacus's q is 1/3 where batch_size / N is 16/42
N, BATCH = 42, 16


def _private(engine_class: type, accountant: str = "prv",
             **kwargs: object) -> tuple[object, DataLoader]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,))),
                        batch_size=BATCH)
    engine = engine_class(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make = (engine.make_private_with_epsilon if "target_epsilon" in kwargs
                else engine.make_private)
        _, optimizer, private = make(module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                             lr=0.1),
                                     data_loader=loader, max_grad_norm=1.0, **kwargs)
    return optimizer, private


def test_make_private_samples_at_opacus_rate_when_the_batch_does_not_divide_the_dataset():
    ours, ours_loader = _private(PrivacyEngine, noise_multiplier=1.0)
    theirs, theirs_loader = _private(opacus.PrivacyEngine, noise_multiplier=1.0)
    assert ours_loader.sample_rate == pytest.approx(1 / 3)
    assert theirs_loader.sample_rate == pytest.approx(1 / 3)
    assert len(ours_loader) == len(theirs_loader) == 3
    assert ours.expected_batch_size == pytest.approx(theirs.expected_batch_size) == 14


def test_make_private_with_epsilon_calibrates_at_opacus_rate():
    from dptrain.opacus.accountants.utils import get_noise_multiplier  # Opacus's bisection

    ours, _ = _private(PrivacyEngine, "rdp", target_epsilon=5.0, target_delta=1e-5, epochs=2)
    assert ours.noise_multiplier == get_noise_multiplier(
        target_epsilon=5.0, target_delta=1e-5, sample_rate=1 / 3, epochs=2, accountant="rdp")


def test_dp_data_loader_from_data_loader_samples_at_opacus_rate():
    from opacus.data_loader import DPDataLoader as OpacusDPDataLoader

    from dptrain.opacus.data_loader import DPDataLoader

    loader = DataLoader(TensorDataset(torch.randn(N, 4)), batch_size=BATCH)
    ours = DPDataLoader.from_data_loader(loader, distributed=False)
    theirs = OpacusDPDataLoader.from_data_loader(loader, distributed=False)
    assert ours.sample_rate == theirs.sample_rate == 1 / 3
    assert len(ours) == len(theirs) == 3
