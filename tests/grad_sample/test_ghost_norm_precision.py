"""Ghost norms never undershoot: each sample's clipped contribution stays <= C in every dtype.

The ghost identity ``||G^T A||^2 = <A A^T, G G^T>`` cancels when a sample's per-position terms
``g_t a_t^T`` nearly cancel: two positions with almost equal inputs and opposite output gradients.
The per-sample gradient is then ``g_1 (a_1 - a_2)^T`` (``g_2 = -g_1``), whose norm
``||g_1|| ||a_1 - a_2||`` is computed here in float64 without cancellation (the difference of two
float32 numbers is exact in float64; for float64 inputs each entry is within one rounding): the
reference for "the sample's contribution to the clipped sum", factor times true norm.
"""

import pytest
import torch
from torch import Tensor, nn

from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.privacy.clipping import FlatClipper
from tests.op_tally import OpTally


def cancelling_batch(dtype: torch.dtype, batch: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs ``[B, 2, 16]`` (second position = first + a tiny offset), output gradients
    ``[B, 2, 16]`` (second = minus first), and the exact per-sample gradient norms (float64)."""
    generator = torch.Generator().manual_seed(0)
    first = 100 * torch.randn(batch, 1, 16, generator=generator, dtype=torch.float64)
    offset_scale = 10 ** -(1 + 3 * torch.rand(batch, 1, 1, generator=generator, dtype=torch.float64))
    offset = offset_scale * torch.randn(batch, 1, 16, generator=generator, dtype=torch.float64)
    x = torch.cat([first, first + offset], dim=1).to(dtype)
    grad = torch.randn(batch, 1, 16, generator=generator, dtype=torch.float64).to(dtype)
    target = torch.cat([grad, -grad], dim=1)
    diff = x[:, 0].double() - x[:, 1].double()  # exact for float32, within 1 ulp for float64
    exact = grad[:, 0].double().norm(dim=1) * diff.norm(dim=1)
    return x, target, exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clipped_contribution_of_cancelling_positions_is_at_most_C(dtype) -> None:
    x, target, exact = cancelling_batch(dtype)
    layer = nn.Linear(16, 16, bias=False, dtype=dtype)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(x) * target).sum().backward()  # d(loss)/d(output) = target: G is exactly known
    bound = exact.median().item() / 2  # half the samples' true norms are above 2 C
    factors = FlatClipper(bound).factors(ghost.squared_norms())[layer.weight]
    contributions = factors.double() * exact
    assert contributions.max().item() <= bound, f"worst contribution {contributions.max().item() / bound:.6f} C"


def big_small_minus_big(dtype: torch.dtype, batch: int = 16, width: int = 8) -> tuple[Tensor, Tensor]:
    """Output gradients ``[B, 3, width]`` ``(1e4 v, 1e-3 w, -1e4 v)``: their sum, ``1e-3 w`` (the
    second row exactly), is lost to rounding when the big rows are added first. Returns it too."""
    generator = torch.Generator().manual_seed(1)
    v, w = (torch.randn(batch, 1, width, generator=generator, dtype=torch.float64) for _ in range(2))
    grads = torch.cat([1e4 * v, 1e-3 * w, -1e4 * v], dim=1).to(dtype)
    return grads, grads[:, 1].double()


def assert_within_bound(ghost: GhostClippingModule, exact: Tensor) -> None:
    """Flat-clip with C = half the median true norm; assert factor * true norm <= C per sample."""
    bound = exact.median().item() / 2
    factors = FlatClipper(bound).factors(ghost.squared_norms())
    contributions = next(iter(factors.values())).double() * exact
    assert contributions.max().item() <= bound, f"worst contribution {contributions.max().item() / bound:.6f} C"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clipped_contribution_of_a_bias_whose_positions_cancel_is_at_most_C(dtype) -> None:
    grads, bias_grad = big_small_minus_big(dtype)
    layer = nn.Linear(4, 8, dtype=dtype)
    layer.weight.requires_grad_(False)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(torch.randn(16, 3, 4, dtype=dtype)) * grads).sum().backward()
    assert_within_bound(ghost, bias_grad.norm(dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clipped_contribution_of_an_embedding_whose_equal_tokens_cancel_is_at_most_C(dtype) -> None:
    grads, row_grad = big_small_minus_big(dtype)
    layer = nn.Embedding(5, 8, dtype=dtype)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(torch.full((16, 3), 2)) * grads).sum().backward()  # one token: its rows add up
    assert_within_bound(ghost, row_grad.norm(dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clipped_contribution_of_a_tied_embedding_and_head_that_cancel_is_at_most_C(dtype) -> None:
    # Each sample's embedding row e (token 2) and head row -e cancel up to a head row 3 of
    # 1e-9 * a: the three terms of the tied weight's squared norm are ~1e24, their sum ~1e6.
    generator = torch.Generator().manual_seed(2)
    vectors = 1e12 * torch.randn(16, 1, 8, generator=generator, dtype=torch.float64)
    e = vectors.to(dtype)
    head_grads = torch.zeros(16, 1, 5, dtype=dtype)
    head_grads[:, 0, 2], head_grads[:, 0, 3] = -1.0, 1e-9

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(5, 8, dtype=dtype), nn.Linear(8, 5, bias=False, dtype=dtype)
            self.head.weight = self.emb.weight

        def forward(self, tokens: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
            return self.emb(tokens), self.head(a)

    ghost = GhostClippingModule(Tied(), loss_reduction="sum", strategy="ghost")
    embedded, logits = ghost(torch.full((16, 1), 2), e.clone())
    ((embedded * e).sum() + (logits * head_grads).sum()).backward()
    exact = head_grads[:, 0, 3].double().abs() * e[:, 0].double().norm(dim=1)  # ||E + H|| = ||1e-9 a||
    assert_within_bound(ghost, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clipped_contribution_of_a_convolution_whose_positions_cancel_is_at_most_C(dtype) -> None:
    x, target, exact = cancelling_batch(dtype)  # [B, 2 positions, 16 channels]
    layer = nn.Conv1d(16, 16, 1, bias=False, dtype=dtype)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(x.transpose(1, 2)) * target.transpose(1, 2)).sum().backward()
    assert_within_bound(ghost, exact)


def test_float32_norm_of_a_cancelling_sample_is_recomputed_from_float64_grams() -> None:
    # M^2 reaches 7e12 times the squared norm: float32 Grams would bound it by up to 1e7 times it
    # (round-off ~ 2^-24 (d + p) M^2), the float64 recomputation within 3% (~ 2^-53 (d + p) M^2)
    x, target, exact = cancelling_batch(torch.float32)
    layer = nn.Linear(16, 16, bias=False)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(x) * target).sum().backward()
    ratio = ghost.squared_norms()[layer.weight].double() / exact.square()
    assert bool((ratio >= 1).all())
    assert ratio.max().item() <= 1.1


def test_when_every_sample_cancels_the_float64_recomputation_gathers_no_rows() -> None:
    x, target, _ = cancelling_batch(torch.float32)
    layer = nn.Linear(16, 16, bias=False)
    ghost = GhostClippingModule(layer, loss_reduction="sum", strategy="ghost")
    (ghost(x) * target).sum().backward()
    with OpTally(lambda func, args, kwargs, out: int(func.overloadpacket is torch.ops.aten.index)) as gathers:
        ghost.squared_norms()
    assert gathers.total == 0
