"""A tiny private run to audit: a linear model on random data, trained by plain DP-SGD."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dptrain.privacy.charge import Charge
from dptrain.privacy.clipping import FlatClipper
from dptrain.privacy.engine import PrivacyEngine
from dptrain.privacy.optimizer import DPOptimizer

DELTA = 1e-5


@dataclass
class PrivateRun:
    """make_private's outputs and a `train()` that runs `steps` logical steps."""

    model: Any
    optimizer: Any
    loader: Any
    engine: PrivacyEngine
    steps: int

    def train(self) -> None:
        done = 0
        while done < self.steps:
            for x, y in self.loader:
                self.optimizer.zero_grad()
                nn.functional.cross_entropy(self.model(x), y).backward()
                self.optimizer.step()
                done += 1
                if done == self.steps:
                    return


def random_classification(size: int, features: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(size, features, generator=gen),
                         torch.randint(0, 10, (size,), generator=gen))


def private_linear_run(*, noise_multiplier: float, steps: int, seed: int = 0, size: int = 500,
                       features: int = 500, sample_rate: float = 0.1,
                       engine_class: Callable[..., PrivacyEngine] = PrivacyEngine,
                       accountant: str = "prv", dataset: Dataset | None = None,
                       **make_private: Any) -> PrivateRun:
    """A Linear(features, 10) model (features * 10 + 10 coordinates) under DP-SGD, C = 1, on
    `dataset` (default: `size` random examples)."""
    torch.manual_seed(seed)
    model = nn.Linear(features, 10)
    data = dataset if dataset is not None else random_classification(size, features, seed)
    loader = DataLoader(data, batch_size=round(sample_rate * len(data)))
    engine = engine_class(accountant=accountant, seed=seed, reproducible_mechanism=True)
    module, optimizer, private_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=noise_multiplier, max_grad_norm=1.0, **make_private)
    return PrivateRun(module, optimizer, private_loader, engine, steps)


# -- planted bugs: test builds of the mechanism, never shipped -------------------------------
class NoClipClipper(FlatClipper):
    """Flat clipping that forgets to clip (every factor 1); reports the same sensitivity C."""

    def factors(self, squared: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return {p: torch.ones_like(s) for p, s in squared.items()}


class TooLittleNoiseOptimizer(DPOptimizer):
    """Adds noise of std sigma C / 10 while the accountant is told sigma."""

    def _gradient_noise_std(self) -> float:
        return super()._gradient_noise_std() / 10


class UnderCountingEngine(PrivacyEngine):
    """Steps the accountant with q / 10 while the loader samples with q."""

    def _account_charge(self, charge: Charge) -> None:
        self.accountant.step(noise_multiplier=charge.noise_multiplier,
                             sample_rate=charge.sample_rate / 10)


def plant_no_clipping(run: PrivateRun) -> PrivateRun:
    run.optimizer.clipper = NoClipClipper(run.optimizer.max_grad_norm)
    return run


def plant_too_little_noise(run: PrivateRun) -> PrivateRun:
    run.optimizer.__class__ = TooLittleNoiseOptimizer
    return run
