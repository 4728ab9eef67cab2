"""The privacy.noise, privacy.noise_bands and privacy.noise_buffers keys: parsed into the plan's
noise strategy (optimised for the run's steps), refused by name when they cannot be used."""

from __future__ import annotations

import pytest
import torch

from dptrain.cli.build import sgd_momentum
from dptrain.cli.privacy_config import PrivacyGroup
from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt, Independent

SIGMA = {"name": "sigma", "noise_multiplier": 1.0}


def test_the_default_noise_is_independent():
    plan = PrivacyGroup.parse(SIGMA).plan(0.1, 1e-5, steps=30)
    assert plan.noise.strategy == Independent()


def test_banded_noise_is_optimised_for_the_runs_steps_with_its_bands():
    request = PrivacyGroup.parse({**SIGMA, "noise": "banded", "noise_bands": 3})
    strategy = request.plan(0.1, 1e-5, steps=30).noise.strategy
    assert strategy == Banded.optimised(3, 30)


def test_blt_noise_gets_its_buffers():
    request = PrivacyGroup.parse({**SIGMA, "noise": "blt", "noise_buffers": 2})
    strategy = request.plan(0.1, 1e-5, steps=40).noise.strategy
    assert isinstance(strategy, Blt) and strategy.buffers == 2


@pytest.mark.parametrize("keys,named", [
    ({"noise": "banded"}, "privacy.noise_bands"),
    ({"noise_bands": 4}, "privacy.noise_bands"),
    ({"noise": "blt", "noise_bands": 4}, "privacy.noise_bands"),
    ({"noise": "banded", "noise_bands": 4, "noise_buffers": 2}, "privacy.noise_buffers"),
    ({"noise": "banded", "noise_bands": 0}, "privacy.noise_bands"),
    ({"noise": "correlated"}, "privacy.noise"),
])
def test_noise_keys_that_cannot_be_used_are_refused_by_name(keys, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        PrivacyGroup.parse({**SIGMA, **keys})


def test_sgd_momentum_is_the_workload_correlated_noise_is_optimised_for():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert sgd_momentum(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 0.9
    assert sgd_momentum(torch.optim.Adam(params, lr=0.1)) == 0.0


def test_banded_noise_alone_is_sampled_in_as_many_cyclic_groups_as_bands():
    request = PrivacyGroup.parse({**SIGMA, "noise": "banded", "noise_bands": 3})
    selection = request.plan(0.1, 1e-5, steps=30).selection
    assert (selection.kind, selection.groups) == ("cyclic_poisson", 3)


def test_blt_noise_alone_is_sampled_once_every_floor_one_over_q_steps_and_optimised_for_it():
    request = PrivacyGroup.parse({**SIGMA, "noise": "blt"})
    plan = request.plan(0.03, 1e-5, steps=100)
    assert (plan.selection.kind, plan.selection.groups) == ("cyclic_poisson", 33)
    assert plan.noise.strategy == Blt.optimised(3, 100, min_sep=33, max_participations=4)
