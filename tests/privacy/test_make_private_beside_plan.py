"""make_private(plan=...): a keyword given beside a plan agrees with it or is refused.

The engine runs the mechanism of the plan and records the plan (the ledger's `plan`), so a
keyword that contradicted it would either be ignored or, as noise_schedule once did, replace
the plan's value in the mechanism while the record kept the plan's: the ledger would describe
a mechanism that did not run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded
from dptrain.privacy.engine import PrivacyEngine

N, BATCH = 40, 4


def _loader() -> DataLoader:
    data = TensorDataset(torch.randn(N, 3), torch.randint(2, (N,)))
    return DataLoader(data, batch_size=BATCH)


def _plan(**keywords):
    """The plan of make_private's keywords (sigma 1.0, C 1.0, Poisson, flat, constant sigma)."""
    return PrivacyEngine(accountant="rdp").plan_of(_loader(), noise_multiplier=1.0, **keywords)


def _make_private(plan, **beside):
    model = nn.Linear(3, 2)
    engine = PrivacyEngine.for_plan(plan)
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        data_loader=_loader(), plan=plan, **beside)
    return engine


# every keyword of make_private that describes a plan, with a value the plan does not hold
CONTRADICTIONS = [
    ("noise_multiplier", 2.0),
    ("max_grad_norm", 1.0),             # the plan's C is 0.5: the default's value, given
    ("max_grad_norm", 3.0),
    ("clipping", "adaptive"),
    ("target_unclipped_quantile", 0.9),
    ("clipbound_learning_rate", 0.05),
    ("count_noise_std", 3.0),
    ("poisson_sampling", False),
    ("sampling", "shuffle"),
    ("sampling_groups", 2),
    ("noise_schedule", {"kind": "exponential", "gamma": 0.5}),
    ("sample_rate_schedule", {"kind": "exponential", "gamma": 0.9}),
    ("privacy_unit", "user"),
    ("max_examples_per_user", 2),
    ("noise_strategy", Banded((1.0, 0.5))),
]


@pytest.mark.parametrize("name, value", CONTRADICTIONS, ids=[f"{n}={v!r}" for n, v in CONTRADICTIONS])
def test_a_keyword_that_contradicts_the_plan_is_refused_naming_it(name, value):
    plan = _plan(max_grad_norm=0.5)
    with pytest.raises(ConfigError, match=rf"{name}=.*differs from the plan's"):
        _make_private(plan, **{name: value})


def test_a_noise_schedule_beside_a_plan_no_longer_replaces_the_recorded_constant_sigma():
    plan = _plan()
    with pytest.raises(ConfigError, match="noise_schedule"):
        _make_private(plan, noise_schedule={"kind": "exponential", "gamma": 0.5})


def test_keywords_that_agree_with_the_plan_are_accepted_and_the_plan_recorded_as_is():
    plan = _plan(max_grad_norm=0.5, noise_schedule={"kind": "exponential", "gamma": 0.99})
    engine = _make_private(plan, noise_multiplier=1.0, max_grad_norm=0.5, clipping="flat",
                           poisson_sampling=True, sampling="poisson", privacy_unit="example",
                           noise_schedule={"kind": "exponential", "gamma": 0.99})
    assert engine.plan == plan.with_dataset(N)


def test_a_python_schedule_named_by_the_plan_is_taken_from_the_keyword_and_recorded():
    def halving(step: int) -> float:
        return 1.0 / 2 ** step

    plan = _plan(noise_schedule=lambda step: 1.0)
    engine = _make_private(plan, noise_schedule=halving)
    assert engine.plan.noise.schedule == {"kind": "python", "repr": repr(halving)}
    assert engine.optimizer.noise_schedule(3) == 1.0 / 8


def test_a_grad_sample_mode_beside_performance_settings_must_agree():
    from dptrain.privacy.plan import PerformanceSettings

    with pytest.raises(ConfigError, match="grad_sample_mode='hooks' differs"):
        _make_private(_plan(), performance=PerformanceSettings(grad_sample_mode="ghost"),
                      grad_sample_mode="hooks")


def test_make_private_without_a_plan_keeps_its_keyword_defaults():
    model = nn.Linear(3, 2)
    private = dptrain.make_private(module=model, data_loader=_loader(), noise_multiplier=1.0,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    plan = private.engine.plan
    assert (plan.clipping.max_grad_norm, plan.clipping.kind, plan.selection.kind,
            plan.unit.kind) == (1.0, "flat", "poisson", "example")
