"""Shared helpers of the ghost-clipping tests (no tests here).

``clipped_sums`` runs one batched forward/backward through a wrapper (hooks or ghost), turns the
per-sample squared norms into flat clipping factors ``c_i = min(1, C / ||g_i||)`` and returns the
clipped sums, so that the two modes can be compared exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from tests.op_tally import fresh_outputs

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule

F64 = torch.float64
TOL = 1e-10
REGIMES = ("all_clipped", "none_clipped", "mixed")


def sum_loss(output: Tensor, target: Tensor) -> Tensor:
    """Every output entry weighted by a fixed random target of the same shape (sum reduction)."""
    return (output * target).sum()


def per_sample_sq_norms(wrapper: GradSampleModule) -> Tensor:
    """Total squared norm of each sample's gradient over all parameters, ``[B]``."""
    return torch.stack(list(wrapper.squared_norms().values())).sum(dim=0)


def run(
    wrapper_cls: type[GradSampleModule],
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    target: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = sum_loss,
    reduction: str = "sum",
    **kwargs,
) -> GradSampleModule:
    """Wrap a deep copy of ``model`` and run one forward/backward pass on ``inputs``."""
    wrapper = wrapper_cls(copy.deepcopy(model), loss_reduction=reduction, **kwargs)
    loss_fn(wrapper(*inputs), target).backward()
    return wrapper


def clipping_bound(norms: Tensor, regime: str) -> float:
    """C such that every sample (all_clipped), none (none_clipped) or about half is clipped."""
    lengths = norms.sqrt()
    if regime == "all_clipped":
        return 0.5 * lengths.min().item()
    if regime == "none_clipped":
        return 2.0 * lengths.max().item()
    return lengths.median().item()


def clipped_sums(wrapper: GradSampleModule, bound: float) -> dict[str, Tensor]:
    """``{param name: sum_i min(1, C/||g_i||) g_i}`` through the clipping interface."""
    factors = (bound / (per_sample_sq_norms(wrapper).sqrt() + 1e-12)).clamp(max=1.0)
    params = dict(wrapper.trainable_parameters())
    sums = wrapper.weighted_sum({p: factors for p in params.values()})
    return {name: sums[p] for name, p in params.items()}


def assert_ghost_matches_hooks(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    regime: str,
    target: Tensor | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = sum_loss,
    reduction: str = "sum",
    **ghost_kwargs,
) -> GhostClippingModule:
    """Assert ghost norms and clipped sums equal the hooks mode's (float64, tight tolerance)."""
    if target is None:
        with torch.no_grad():
            target = torch.randn_like(model(*inputs))
    hooks = run(GradSampleModule, model, inputs, target, loss_fn, reduction)
    ghost = run(GhostClippingModule, model, inputs, target, loss_fn, reduction, **ghost_kwargs)
    expected_norms, got_norms = per_sample_sq_norms(hooks), per_sample_sq_norms(ghost)
    torch.testing.assert_close(got_norms, expected_norms, rtol=TOL, atol=TOL)
    bound = clipping_bound(expected_norms, regime)
    expected, got = clipped_sums(hooks, bound), clipped_sums(ghost, bound)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=TOL, atol=TOL, msg=name)
    return ghost


class LargestAllocation(TorchDispatchMode):
    """Records the most elements of any tensor an operation allocates (views of inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.largest = max([self.largest, *(t.numel() for t in fresh_outputs(args, kwargs or {}, out))])
        return out
