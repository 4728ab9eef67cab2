"""Noise sources: seeded reproducible draws and the secure (OS CSPRNG) mode."""

from __future__ import annotations

import math

import torch
from tests.privacy.privacy_helpers import std_tolerance

from dptrain.randomness import (
    derive_seeds,
    gaussian_noise,
    make_generator,
    secure_standard_normal,
    uniform,
)


def test_zero_std_gives_exact_zeros_without_consuming_randomness():
    gen = make_generator(0)
    state = gen.get_state()
    assert torch.equal(gaussian_noise((3, 2), 0.0, gen, False), torch.zeros(3, 2))
    assert torch.equal(gen.get_state(), state)


def test_seeded_noise_repeats_exactly():
    a = gaussian_noise((100,), 2.0, make_generator(7), False)
    b = gaussian_noise((100,), 2.0, make_generator(7), False)
    assert torch.equal(a, b)


def test_secure_noise_differs_between_calls():
    a = gaussian_noise((100,), 2.0, None, True)
    b = gaussian_noise((100,), 2.0, None, True)
    assert not torch.equal(a, b)


def test_secure_noise_has_the_requested_std_and_zero_mean():
    n = 200_000
    draws = gaussian_noise((n,), 3.0, None, True, dtype=torch.float64)
    assert abs(draws.std().item() / 3.0 - 1) < std_tolerance(n)
    assert abs(draws.mean().item()) < 6 * 3.0 / math.sqrt(n)


def test_secure_standard_normal_has_gaussian_tails():
    n = 200_000
    draws = secure_standard_normal(n)
    beyond_two = (draws.abs() > 2).double().mean().item()
    p = 0.0455  # P(|Z| > 2)
    assert abs(beyond_two - p) < 6 * math.sqrt(p * (1 - p) / n)


def test_secure_uniforms_lie_strictly_inside_zero_one():
    u = uniform(100_000, None, True)
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / u.numel())


def test_noise_has_the_requested_dtype_and_shape():
    out = gaussian_noise((2, 3), 1.0, make_generator(0), False, dtype=torch.bfloat16)
    assert out.shape == (2, 3) and out.dtype == torch.bfloat16


def test_derived_seeds_are_distinct_and_repeatable():
    assert derive_seeds(5, 3) == derive_seeds(5, 3)
    assert len(set(derive_seeds(5, 3))) == 3
