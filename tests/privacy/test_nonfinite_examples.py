"""An example whose per-sample gradient is not finite (a NaN or inf feature, an overflow in its
forward or backward) contributes nothing: the DP step on a batch holding it equals the step on the
batch without it (same noise), in every clipping mode, dtype and per-sample source (hooks, ghost
rules, ghost's re-run of a layer, ghost's instantiated layers) and at user level; how many were
left out is counted for the private metrics. Before, the parameters became NaN at the first step
whose batch held it, and only then: a leak no epsilon bounds."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from privacy_helpers import tiny_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.grad_sample.ghost import GhostClippingModule
from dptrain.grad_sample.module import GradSampleModule
from dptrain.privacy.clipping import make_clipper
from dptrain.privacy.optimizer import DPOptimizer

BAD = 2          # the row of the batch that holds the non-finite feature
BATCH = 6


class SequenceNet(nn.Module):
    """[B, T, 3] -> [B, 2]: a Linear over positions (ghost: Gram norms), a LayerNorm (ghost mode
    "ghost": its clipped sum from a re-run of the layer, ghost_vjp) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.inner(x)))).mean(dim=1)


class ConvNet(nn.Module):
    """[B, 2, 6] -> [B, 2]: a Conv1d (ghost: the convolution rules) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.head = nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


class EmbeddingNet(nn.Module):
    """[B, 4] -> [B, 2]: token ids (columns 0-2, as floats) through an Embedding (ghost: its rules),
    scaled by the example's own float feature (column 3, the one a NaN poisons), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x[:, :3].abs().mul(2).long().clamp(max=4)
        return self.head((self.embedding(ids) * x[:, 3:, None]).sum(dim=1))


MODELS = {"sequence": (SequenceNet, (4, 3)), "conv": (ConvNet, (2, 6)),
          "embedding": (EmbeddingNet, (4,))}
SOURCES = {
    "hooks": lambda m: GradSampleModule(m, loss_reduction="sum"),
    "ghost": lambda m: GhostClippingModule(m, loss_reduction="sum", strategy="ghost"),
    "ghost_instantiate": lambda m: GhostClippingModule(m, loss_reduction="sum",
                                                       strategy="instantiate"),
}


def _batch(model: str, dtype: torch.dtype, poison: float) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, *MODELS[model][1], generator=gen).to(dtype)
    x[BAD].view(-1)[-1] = poison   # the last feature (the embedding model's scale)
    return x, torch.randint(0, 2, (BATCH,), generator=gen)


def _one_step(model: str, source: str, clipping: str, dtype: torch.dtype, x: torch.Tensor,
              y: torch.Tensor, chunks: int = 1) -> tuple[list[torch.Tensor], DPOptimizer]:
    """The parameters after one DP step (sigma 1, noise from a fixed seed) on (x, y), split
    into `chunks` physical chunks; and the optimizer."""
    torch.manual_seed(0)
    net = MODELS[model][0]().to(dtype)
    module = SOURCES[source](net)
    params = [p for p in net.parameters()]
    clipper = make_clipper(clipping, 0.5, params, expected_batch_size=4.0, count_noise_std=2.0)
    optimizer = DPOptimizer(torch.optim.SGD(params, lr=0.5), noise_multiplier=1.0,
                            max_grad_norm=None, expected_batch_size=4.0, clipper=clipper,
                            module=module, sample_rate=0.5,
                            noise_generator=torch.Generator().manual_seed(7))
    optimizer.zero_grad()
    parts = list(zip(x.tensor_split(chunks), y.tensor_split(chunks)))
    for i, (xs, ys) in enumerate(parts):
        nn.functional.cross_entropy(module(xs), ys, reduction="sum").backward()
        optimizer.signal_skip_step(i < len(parts) - 1)
        optimizer.step()
    return [p.detach().clone() for p in params], optimizer


def _assert_same(with_it: list[torch.Tensor], without: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert all(torch.isfinite(p).all() for p in with_it)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    for a, b in zip(with_it, without):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "adaptive"])
@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("model", list(MODELS))
def test_a_nan_feature_example_leaves_the_step_equal_to_the_step_without_it(model, source,
                                                                            clipping, dtype):
    x, y = _batch(model, dtype, math.nan)
    keep = [i for i in range(BATCH) if i != BAD]
    with_it, optimizer = _one_step(model, source, clipping, dtype, x, y)
    without, reference = _one_step(model, source, clipping, dtype, x[keep], y[keep])
    _assert_same(with_it, without, dtype)
    # adaptive clipping: the example is left out of the released unclipped count too
    assert optimizer.max_grad_norm == pytest.approx(reference.max_grad_norm, rel=1e-12)


@pytest.mark.parametrize("poison", [math.inf, -math.inf, 3e38], ids=["inf", "-inf", "overflow"])
@pytest.mark.parametrize("source", list(SOURCES))
def test_an_infinite_or_overflowing_example_leaves_the_step_equal_to_the_step_without_it(
        source, poison):
    x, y = _batch("sequence", torch.float32, poison)
    keep = [i for i in range(BATCH) if i != BAD]
    with_it, _ = _one_step("sequence", source, "flat", torch.float32, x, y)
    without, _ = _one_step("sequence", source, "flat", torch.float32, x[keep], y[keep])
    _assert_same(with_it, without, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("source", ["hooks", "ghost"])
def test_a_nan_example_in_16_bit_parameters_leaves_the_step_equal_to_the_step_without_it(
        source, dtype):
    x, y = _batch("sequence", dtype, math.nan)
    keep = [i for i in range(BATCH) if i != BAD]
    with_it, _ = _one_step("sequence", source, "flat", dtype, x, y)
    without, _ = _one_step("sequence", source, "flat", dtype, x[keep], y[keep])
    _assert_same(with_it, without, dtype)


@pytest.mark.parametrize("source", list(SOURCES))
def test_the_examples_left_out_of_a_step_are_counted_over_its_physical_chunks(source):
    x, y = _batch("sequence", torch.float64, math.nan)
    x[BATCH - 1, 0, 0] = math.inf   # a second one, in the other chunk
    _, optimizer = _one_step("sequence", source, "flat", torch.float64, x, y, chunks=2)
    assert int(optimizer.excluded_examples) == 2
    clean = torch.nan_to_num(x, nan=0.0, posinf=0.0)
    _, optimizer = _one_step("sequence", source, "flat", torch.float64, clean, y, chunks=2)
    assert int(optimizer.excluded_examples) == 0


# ----------------------------------------------------------------------------- user level
def _user_level_sum(x, y, user_ids):
    """The noise-free clipped sum {name: Tensor} of one user-level step at q = 1 and the
    optimizer (make_private, sigma 0, C 0.3), and the model's parameters after the step."""
    model = tiny_model()
    engine = dptrain.PrivacyEngine(accountant="rdp", seed=0, reproducible_mechanism=True)
    users = len(set(user_ids))
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=users),
        noise_multiplier=0.0, max_grad_norm=0.3, privacy_unit="user",
        user_ids=torch.tensor(user_ids))
    captured = {}
    optimizer.attach_step_hook(lambda opt: captured.update(
        {name: p.summed_grad.clone() for name, p in module.trainable_parameters()}))
    xb, yb = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(module(xb), yb).backward()
    optimizer.step()
    return captured, optimizer, [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0.*:UserWarning")
def test_a_user_with_a_nan_example_contributes_nothing_at_user_level():
    user_ids = [0, 0, 0, 1, 1, 2, 3, 3]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(user_ids), 3, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 2, (len(user_ids),), generator=gen)
    x[4, 1] = math.nan                     # one of user 1's two examples
    with_user, optimizer, params = _user_level_sum(x, y, user_ids)
    others = [i for i, u in enumerate(user_ids) if u != 1]
    without_user, _, _ = _user_level_sum(x[others], y[others], [user_ids[i] for i in others])
    assert all(torch.isfinite(p).all() for p in params)
    assert int(optimizer.excluded_examples) == 1   # one user left out
    for name, value in with_user.items():
        torch.testing.assert_close(value, without_user[name], rtol=1e-12, atol=1e-12)
