"""Helpers for the mechanism's tests: per-sample gradients by micro-batch recomputation, and a
tiny per-sample source implementing the clipping interface of contract 1 from given gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dptrain.grad_sample.ghost_math import norm_dtype


def per_sample_grads(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
                     x: Tensor, y: Tensor) -> dict[nn.Parameter, Tensor]:
    """Ground truth: {p: Tensor[B, *p.shape]}, each row from the model run on that sample alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows: list[tuple[Tensor, ...]] = []
    for b in range(x.shape[0]):
        loss = loss_fn(model(x[b:b + 1]), y[b:b + 1])
        rows.append(torch.autograd.grad(loss, params))
    return {p: torch.stack([r[i] for r in rows]) for i, p in enumerate(params)}


class FakeSource(nn.Module):
    """Implements the clipping interface from per-sample gradients handed in with `capture`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._module = model
        self._chunks: list[dict[nn.Parameter, Tensor]] = []
        self.cleared = 0

    def forward(self, x: Tensor) -> Tensor:
        return self._module(x)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]

    def capture(self, grads: dict[nn.Parameter, Tensor]) -> None:
        self._chunks.append(grads)

    def _grads(self) -> dict[nn.Parameter, Tensor]:
        return {p: torch.cat([c[p] for c in self._chunks]) for p in self._chunks[0]}

    def per_sample_batch_size(self) -> int:
        return sum(next(iter(c.values())).shape[0] for c in self._chunks)

    def squared_norms(self) -> dict[nn.Parameter, Tensor]:
        return {p: g.to(norm_dtype(g)).flatten(1).pow(2).sum(1) for p, g in self._grads().items()}

    def weighted_sum(self, weights: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return {p: torch.einsum("b,b...->...", weights[p].to(norm_dtype(g)), g.to(norm_dtype(g)))
                for p, g in self._grads().items()}

    def clear_per_sample(self) -> None:
        self._chunks = []
        self.cleared += 1

    def check_complete(self) -> None:
        return None


def std_tolerance(n: int, sigmas: float = 6.0) -> float:
    """Relative tolerance on a sample std from n normal draws: `sigmas` standard errors."""
    return sigmas / math.sqrt(2 * n)


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def tiny_data(n: int = 8, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 2, (n,), generator=gen)
    return x, y


LOSS = nn.CrossEntropyLoss(reduction="sum")


def clipped_sum(grads: dict[nn.Parameter, Tensor], C: float) -> dict[nn.Parameter, Tensor]:
    """By hand: each sample's gradient scaled to total L2 norm <= C, summed: {p: Tensor[*p.shape]}."""
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factor = torch.clamp(C / norms, max=1.0)
    return {p: torch.einsum("b,b...->...", factor, g) for p, g in grads.items()}


def loop_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]) -> None:
    """One step of a user's own loop on an `(x, y)` batch (an empty batch: noise only)."""
    x, y = batch
    optimizer.zero_grad()
    if len(x):
        nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
