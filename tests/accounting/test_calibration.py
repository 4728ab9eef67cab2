"""get_noise_multiplier: never above the target, within tolerance, clear errors."""

import math

import pytest

from dptrain.accounting import compute_epsilon, get_noise_multiplier
from dptrain.accounting.calibration import steps_for, steps_per_epoch
from dptrain.errors import PrivacyError


@pytest.mark.parametrize("accountant", ["rdp", "gdp", "prv"])
@pytest.mark.filterwarnings("ignore:gdp accountant")
def test_calibrated_sigma_meets_the_target_within_tolerance_and_never_above(accountant):
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02,
                                 steps=300, accountant=accountant, epsilon_tolerance=0.02)
    eps = compute_epsilon([(sigma, 0.02, 300)], 1e-5, accountant=accountant)
    assert 2.0 - 0.02 <= eps <= 2.0


@pytest.mark.parametrize("target", [0.5, 1.0, 4.0, 10.0])
def test_calibrated_sigma_never_exceeds_target_for_rdp(target):
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=1e-6, sample_rate=0.01,
                                 steps=2000)
    assert compute_epsilon([(sigma, 0.01, 2000)], 1e-6) <= target


def test_a_slightly_smaller_sigma_would_exceed_the_target():
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01,
                                 steps=1000, epsilon_tolerance=0.001)
    assert compute_epsilon([(sigma * 0.99, 0.01, 1000)], 1e-5) > 3.0


def test_epochs_are_converted_to_ceil_of_epochs_over_sample_rate():
    by_epochs = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01,
                                     epochs=3)
    by_steps = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01,
                                    steps=300)
    assert by_epochs == by_steps


def test_steps_and_epochs_together_raise_privacy_error():
    with pytest.raises(PrivacyError, match="exactly one of steps"):
        get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01,
                             steps=10, epochs=1)


def test_unreachable_target_raises_naming_target_epsilon_with_achievable_range():
    with pytest.raises(PrivacyError, match=r"target_epsilon=1e-06 is unreachable.*achievable range"):
        get_noise_multiplier(target_epsilon=1e-6, target_delta=1e-5, sample_rate=1.0,
                             steps=1_000_000)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(sample_rate=1.2), "sample_rate"),
    (dict(accountant="moments"), "accountant"),
])
def test_invalid_arguments_raise_privacy_error_naming_them(kwargs, argument):
    args = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=100)
    args.update(kwargs)
    with pytest.raises(PrivacyError, match=argument):
        get_noise_multiplier(**args)


def test_very_loose_target_returns_a_tiny_but_valid_sigma():
    sigma = get_noise_multiplier(target_epsilon=1e4, target_delta=1e-5, sample_rate=0.001, steps=1)
    assert 0 < sigma <= 0.01
    assert compute_epsilon([(sigma, 0.001, 1)], 1e-5) <= 1e4 and math.isfinite(sigma)


def test_calibrate_sigma_needs_few_evaluations_on_a_smooth_curve():
    from dptrain.accounting.calibration import calibrate_sigma

    calls = []

    def epsilon(sigma):
        calls.append(sigma)
        return 10.0 / sigma**2

    sigma = calibrate_sigma(epsilon, target=3.0, tolerance=1e-3)
    assert 3.0 - 1e-3 <= epsilon(sigma) <= 3.0
    assert len(calls) <= 10


def test_calibrate_sigma_returns_only_a_sigma_it_evaluated_at_or_below_the_target():
    from dptrain.accounting.calibration import calibrate_sigma

    seen = {}

    def jagged(sigma):   # non-increasing staircase, like a discretised accountant
        seen[sigma] = math.floor(40.0 / sigma) / 10.0
        return seen[sigma]

    sigma = calibrate_sigma(jagged, target=2.55, tolerance=0.01)
    assert sigma in seen and seen[sigma] <= 2.55


def test_an_epoch_is_ceil_n_over_b_steps_for_every_batch_size_without_rounding_slips():
    for n in range(1, 160):
        for b in range(1, n + 1):
            assert steps_per_epoch(b / n) == math.ceil(n / b) == -(-n // b), (n, b)


def test_epochs_are_counted_in_whole_epochs_of_ceil_one_over_q_steps():
    q = 128 / 1442                        # digits: 11.27 batches of 128 in N = 1442
    assert steps_per_epoch(q) == 12
    assert steps_for(q, None, 3) == 36 and steps_for(q, None, 2.5) == 30
    assert get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, epochs=3) \
        == get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=36)
