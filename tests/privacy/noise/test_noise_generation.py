"""The noise generators: buffered generation equals C^{-1} Z, the DP optimizer's noise has the
covariance its strategy promises, independent noise is DP-SGD's bit for bit, and the buffers
resume exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt, Independent
from dptrain.privacy.noise.toeplitz import dense_matrix
from dptrain.randomness import make_generator

from noise_helpers import BATCH, noise_optimizer, noise_steps

STRATEGIES = [Banded((1.0, 0.6, 0.3, 0.1)), Blt((0.9, 0.5), (0.3, 0.2))]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_buffered_generation_equals_the_dense_formula_in_float64(strategy):
    steps, shape = 12, (3, 4)
    draws = torch.randn(steps, *shape, dtype=torch.float64, generator=make_generator(1))
    generator = strategy.generator()
    buffered = torch.stack([generator(0, d.clone()) for d in draws])
    c = torch.from_numpy(dense_matrix(strategy.toeplitz_column(steps), steps))
    dense = torch.linalg.solve_triangular(c, draws.reshape(steps, -1), upper=False)
    torch.testing.assert_close(buffered.reshape(steps, -1), dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_the_generator_keeps_at_most_its_stated_copies_of_each_parameter(strategy):
    generator = strategy.generator()
    for _ in range(10):
        generator(0, torch.randn(5))
        generator(1, torch.randn(2, 2))
    assert [len(generator.buffers[k]) for k in (0, 1)] == [strategy.extra_copies] * 2
    assert strategy.extra_copies == (3 if strategy.name == "banded" else 2)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_the_optimizers_noise_has_the_covariance_the_strategy_promises(strategy):
    # 10,100 coordinates of a small model, each an independent run of the noise process over
    # T steps: their empirical T x T covariance must match C^{-1} C^{-T} (sigma = C = 1).
    torch.manual_seed(0)
    steps = 8
    optimizer, source = noise_optimizer(nn.Linear(100, 100), strategy, seed=3)
    noise = torch.stack(noise_steps(optimizer, source, steps)).double()  # (T, coords)
    empirical = noise @ noise.T / noise.shape[1]
    c_inv = np.linalg.inv(dense_matrix(strategy.toeplitz_column(steps), steps))
    promised = torch.from_numpy(c_inv @ c_inv.T)
    # standard error of each entry: sqrt((S_ss S_tt + S_st^2) / n)
    diag = promised.diagonal()
    stderr = ((diag[:, None] * diag[None, :] + promised ** 2) / noise.shape[1]).sqrt()
    assert ((empirical - promised).abs() / stderr).max() < 5.0


def test_independent_noise_is_dp_sgds_noise_bit_for_bit_with_a_seed():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer, source = noise_optimizer(model, Independent(), seed=11)
    got = noise_steps(optimizer, source, 3)
    generator = make_generator(11)
    for step in got:
        expected = torch.cat([torch.normal(0.0, 1.0 / BATCH, size=p.shape, generator=generator)
                              .reshape(-1) for p in model.parameters()]) * BATCH
        assert torch.equal(step, expected)


def test_the_default_strategy_is_independent_noise_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    default = noise_steps(*noise_optimizer(model, None, seed=5), 3)
    independent = noise_steps(*noise_optimizer(model, Independent(), seed=5), 3)
    assert all(torch.equal(a, b) for a, b in zip(default, independent))


def _checkpoint_round_trip(state):
    """`state` through torch.save / torch.load(weights_only=True), as checkpoints are read."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_a_resumed_run_draws_the_same_noise_as_an_uninterrupted_one(strategy):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    whole = noise_steps(*noise_optimizer(model, strategy, seed=9), 7)
    first, source = noise_optimizer(model, strategy, seed=9)
    before = noise_steps(first, source, 3)
    saved = _checkpoint_round_trip({"dp": first.dp_state_dict(),
                                    "generator": first.noise_generator.get_state()})
    second, source = noise_optimizer(model, strategy, seed=None)
    second.noise_generator = make_generator(0)
    second.noise_generator.set_state(saved["generator"])
    second.load_dp_state_dict(saved["dp"])
    after = noise_steps(second, source, 4)
    assert all(torch.equal(a, b) for a, b in zip(whole, before + after))


def test_a_run_resumed_without_its_buffers_would_draw_other_noise():
    # what the saved buffers guard: the same generator state alone does not give the same noise
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    strategy = STRATEGIES[0]
    whole = noise_steps(*noise_optimizer(model, strategy, seed=9), 5)
    first, source = noise_optimizer(model, strategy, seed=9)
    noise_steps(first, source, 3)
    second, source = noise_optimizer(model, strategy, seed=None)
    second.noise_generator = make_generator(0)
    second.noise_generator.set_state(first.noise_generator.get_state())
    after = noise_steps(second, source, 2)
    assert not torch.equal(after[0], whole[3])


def test_the_saved_buffers_of_another_strategy_are_refused():
    model = nn.Linear(5, 3)
    first, source = noise_optimizer(model, STRATEGIES[0], seed=9)
    noise_steps(first, source, 2)
    other, _ = noise_optimizer(model, STRATEGIES[1], seed=9)
    with pytest.raises(ConfigError, match="noise strategy"):
        other.load_dp_state_dict(first.dp_state_dict())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_secure_mode_draws_correlated_noise_too(strategy):
    model = nn.Linear(4, 2)
    optimizer, source = noise_optimizer(model, strategy, seed=None)
    optimizer.secure_mode, optimizer.noise_generator = True, None
    steps = noise_steps(optimizer, source, 3)
    assert all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in steps)
    assert len(optimizer.noise_generator_state.buffers[0]) == strategy.extra_copies


@pytest.mark.parametrize("strategy", [Banded.optimised(8, 500),
                                      Blt((0.998, 0.95, 0.6), (0.1, 0.2, 0.3))],
                         ids=lambda s: s.name)
def test_over_many_float32_steps_the_noise_stays_c_inverse_z_without_drift(strategy):
    # C applied to the 500 noise outputs gives back the i.i.d. draws (regenerated from the
    # seed) to float32 precision: no error builds up in the buffers of a long run.
    torch.manual_seed(0)
    steps = 500
    model = nn.Linear(10, 5)
    noise = torch.stack(noise_steps(*noise_optimizer(model, strategy, seed=21), steps)).double()
    c = torch.from_numpy(strategy.toeplitz_column(steps))
    # (C y)_t = sum_k c_k y_{t-k}, a causal convolution along the steps, for every coordinate
    rebuilt = torch.stack([(c[:t + 1].flip(0)[:, None] * noise[:t + 1]).sum(0)
                           for t in range(steps)])
    generator = make_generator(21)
    draws = torch.stack([torch.cat([torch.normal(0.0, 1.0 / BATCH, size=p.shape,
                                                 generator=generator).reshape(-1)
                                    for p in model.parameters()]) * BATCH
                         for _ in range(steps)]).double()
    assert (rebuilt - draws).abs().max() < 1e-4
    assert draws.std().item() == pytest.approx(1.0, rel=0.05)
