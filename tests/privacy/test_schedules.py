"""Noise-multiplier and sample-rate schedules."""

from __future__ import annotations

import pytest

from dptrain.errors import ConfigError
from dptrain.privacy.schedules import (
    ConstantSchedule,
    ExponentialSchedule,
    LambdaSchedule,
    StepSchedule,
    as_schedule,
)


def test_constant_schedule_keeps_its_value():
    assert [ConstantSchedule(1.1)(t) for t in (0, 5, 50)] == [1.1, 1.1, 1.1]


def test_exponential_schedule_multiplies_by_gamma_every_step():
    schedule = ExponentialSchedule(2.0, 0.5)
    assert [schedule(t) for t in range(3)] == [2.0, 1.0, 0.5]


def test_step_schedule_multiplies_by_gamma_every_step_size_steps():
    schedule = StepSchedule(1.0, step_size=2, gamma=2.0)
    assert [schedule(t) for t in range(5)] == [1.0, 1.0, 2.0, 2.0, 4.0]


def test_callable_schedule_calls_the_user_function():
    assert LambdaSchedule(lambda t: 1.0 + t)(3) == 4.0


def test_state_dict_round_trip_restores_the_parameters():
    saved = StepSchedule(1.0, step_size=3, gamma=0.9).state_dict()
    fresh = StepSchedule(5.0, step_size=1, gamma=0.1)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved


def test_loading_another_kinds_state_is_a_config_error():
    with pytest.raises(ConfigError, match="exponential"):
        ConstantSchedule(1.0).load_state_dict(ExponentialSchedule(1.0, 0.5).state_dict())


def test_dict_spec_defaults_initial_to_the_configured_value():
    schedule = as_schedule({"kind": "exponential", "gamma": 0.5}, 4.0, "noise_schedule")
    assert schedule(1) == 2.0


def test_dict_spec_with_unknown_kind_names_the_argument():
    with pytest.raises(ConfigError, match="noise_schedule: unknown schedule kind 'cosine'"):
        as_schedule({"kind": "cosine"}, 1.0, "noise_schedule")


def test_non_positive_gamma_is_a_config_error():
    with pytest.raises(ConfigError, match="gamma"):
        ExponentialSchedule(1.0, 0.0)


def test_non_integer_step_size_is_a_config_error():
    with pytest.raises(ConfigError, match="step_size"):
        StepSchedule(1.0, step_size=0.5, gamma=0.5)
