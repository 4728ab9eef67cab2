"""Helpers for the noise-strategy tests: the noise a DPOptimizer adds, step by step."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/privacy: privacy_helpers
from privacy_helpers import FakeSource  # noqa: E402

from dptrain.privacy.optimizer import DPOptimizer  # noqa: E402
from dptrain.randomness import make_generator  # noqa: E402

BATCH = 4  # examples per step (zero gradients: p.grad is the noise / BATCH)


def noise_optimizer(model: nn.Module, strategy=None, seed: int | None = 0,
                    sigma: float = 1.0) -> tuple[DPOptimizer, FakeSource]:
    """A DPOptimizer (lr 0, clipping norm 1, expected batch BATCH) whose noise comes from a
    generator seeded with `seed` through `strategy`."""
    source = FakeSource(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), sigma, 1.0, BATCH,
                            module=source, sample_rate=0.5,
                            noise_generator=None if seed is None else make_generator(seed),
                            noise_strategy=strategy)
    return optimizer, source


def noise_steps(optimizer: DPOptimizer, source: FakeSource, steps: int) -> list[Tensor]:
    """The noise of `steps` steps with all-zero per-sample gradients: [Tensor[num_params]] in
    units of sigma * C (p.grad * BATCH, every parameter flattened in order)."""
    params = optimizer.params
    out = []
    for _ in range(steps):
        source.capture({p: torch.zeros(BATCH, *p.shape, dtype=p.dtype) for p in params})
        optimizer.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in params]) * BATCH)
        optimizer.zero_grad()
    return out
