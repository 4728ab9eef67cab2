"""The plan's batch selection with cyclic Poisson sampling and correlated noise: the one rule
that picks it, the refusals, what it is charged as, and the engine that trains it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.accounting import compute_epsilon, get_noise_multiplier
from dptrain.accounting.events import AccountingEvent
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.noise import Banded, Blt, Independent
from dptrain.accounting.shuffle import shuffle_epsilon
from dptrain.privacy.plan import (
    COMMAND_SELECTIONS,
    Clipping,
    Noise,
    PrivacyPlan,
    Selection,
    calibrated,
    selection_for,
)
from dptrain.train.ledger.verification import epsilon_of, ledger_sampling


def _banded(bands: int) -> Banded:
    """A banded strategy of b bands, column (1, 1/2, 1/4, ...) normalised to norm 1."""
    return Banded(tuple(0.5 ** np.arange(bands)))


def _blt() -> Blt:
    """A one-buffer BLT strategy (column 1, 0.3, 0.27, 0.243, ...: more bands than any groups)."""
    return Blt((0.9,), (0.3,))


def _plan(selection: Selection, noise: Noise | None = None, **overrides: Any) -> PrivacyPlan:
    return PrivacyPlan(selection=selection, clipping=Clipping(1.0),
                       noise=noise or Noise(multiplier=1.0), delta=1e-5, **overrides)


def test_banded_noise_alone_picks_cyclic_poisson_with_as_many_groups_as_bands():
    noise = Noise(multiplier=1.0, strategy=_banded(4))
    assert selection_for(noise, 0.01) == Selection(0.01, kind="cyclic_poisson", groups=4)
    assert selection_for(Noise(multiplier=1.0), 0.01) == Selection(0.01)


def test_blt_noise_alone_picks_cyclic_poisson_with_one_group_per_step_of_an_epoch():
    noise = Noise(multiplier=1.0, strategy=_blt())
    assert selection_for(noise, 0.03) == Selection(0.03, kind="cyclic_poisson", groups=33)
    assert selection_for(noise, 0.03).min_separation == 33
    assert selection_for(noise, 0.03, kind="shuffle") == Selection(0.03, kind="shuffle")


def test_groups_given_alone_mean_cyclic_poisson():
    assert selection_for(Noise(multiplier=1.0), 0.01, groups=3).kind == "cyclic_poisson"


@pytest.mark.parametrize("selection", [Selection(0.01), Selection(0.01, "cyclic_poisson", None, 2)])
def test_banded_noise_with_a_selection_sampling_an_example_within_its_bands_is_refused(selection):
    with pytest.raises(ConfigError, match="privacy.sampling_groups=4"):
        _plan(selection, Noise(multiplier=1.0, strategy=_banded(4)))


def test_more_groups_than_bands_and_shuffled_batches_are_accepted_with_banded_noise():
    noise = Noise(multiplier=1.0, strategy=_banded(4))
    assert _plan(Selection(0.01, "cyclic_poisson", None, 8), noise).accounting.amplified(100)
    assert not _plan(Selection(0.01, "shuffle"), noise).accounting.amplified(100)


def test_the_callers_own_loader_takes_independent_noise_but_not_correlated_noise():
    given = Selection(0.01, "given")
    assert _plan(given, Noise(multiplier=1.0, strategy=Independent())).accounting.plain
    for strategy in (_banded(2), _blt()):
        with pytest.raises(ConfigError, match="correlated noise"):
            _plan(given, Noise(multiplier=1.0, strategy=strategy))


def test_the_callers_loader_kept_as_a_shuffle_is_recorded_as_kept_and_recomputed_as_a_shuffle():
    plan = _plan(Selection(0.25, "given_shuffle"))
    recorded = plan.to_dict()
    assert recorded["selection"]["kind"] == "given_shuffle"
    assert PrivacyPlan.from_dict(recorded) == plan
    assert plan.accounting == AccountingEvent("shuffle") and plan.selection.shuffled
    assert "given_shuffle" not in COMMAND_SELECTIONS  # a Python-API selection only
    history = [(1.0, 0.25, 12)]  # 3 epochs of 4 steps
    assert epsilon_of(history, 1e-5, "prv", ledger_sampling({"plan": recorded})) \
        == shuffle_epsilon(history, 1e-5)


@pytest.mark.parametrize("schedule, clipping, refused", [
    (None, "adaptive", "clipping=adaptive"),
    ({"kind": "constant"}, "flat", "sample_rate_schedule"),
])
def test_the_callers_loader_kept_as_a_shuffle_refuses_what_shuffled_batches_refuse(
        schedule, clipping, refused):
    with pytest.raises(ConfigError, match=refused):
        PrivacyPlan(selection=Selection(0.25, "given_shuffle", schedule),
                    clipping=Clipping(1.0, kind=clipping), noise=Noise(multiplier=1.0))


def test_groups_times_q_above_one_is_refused_naming_sampling_groups():
    with pytest.raises(ConfigError, match="privacy.sampling_groups"):
        Selection(0.3, "cyclic_poisson", None, 4)


def test_groups_without_cyclic_poisson_are_refused():
    with pytest.raises(ConfigError, match="privacy.sampling=cyclic_poisson"):
        Selection(0.01, "poisson", None, 2)


def test_a_cyclic_plan_round_trips_through_its_dict_and_is_charged_by_its_groups():
    plan = _plan(Selection(0.05, "cyclic_poisson", None, 4))
    assert PrivacyPlan.from_dict(plan.to_dict()) == plan
    assert plan.accounting == AccountingEvent("cyclic_poisson", 4)


def test_a_plain_plan_is_charged_as_its_selection_alone():
    assert _plan(Selection(0.05)).accounting.plain
    assert _plan(Selection(0.05, "shuffle")).accounting == AccountingEvent("shuffle")


def test_calibrating_a_banded_plan_meets_its_target_epsilon_within_the_tolerance():
    noise = Noise(target_epsilon=3.0, strategy=_banded(4))
    plan = _plan(selection_for(noise, 0.02), noise)
    sigma = calibrated(plan, epochs=2).noise.multiplier
    steps = 2 * 50
    epsilon = compute_epsilon([(sigma, 0.02, steps)], 1e-5, "prv", plan.accounting)
    assert 3.0 - 0.01 <= epsilon <= 3.0
    # the sigma of DP-SGD over its rounds: 25 steps at q_group = 4 q (norm-1 column)
    assert sigma == pytest.approx(get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=0.08, steps=25, accountant="prv"),
        rel=0.01)


def _training(groups: int, batch_size: int = 10):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(100, 3), torch.randint(0, 2, (100,)))
    model = torch.nn.Linear(3, 2)
    engine = dptrain.PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch_size), noise_multiplier=1.0,
        sampling="cyclic_poisson", sampling_groups=groups)
    return engine, module, optimizer, loader


def _step(module, optimizer, x, y):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(module(x), y).backward()
    optimizer.step()


def test_make_private_with_cyclic_poisson_charges_the_rounds_of_each_group():
    engine, module, optimizer, loader = _training(groups=4)
    for x, y in loader:
        _step(module, optimizer, x, y)
    assert engine.accountant.history == [(1.0, 0.1, 10)]
    # 10 steps in 4 groups: at most 3 rounds of DP-SGD at q_group = 0.4
    assert engine.get_epsilon(1e-5) == compute_epsilon([(1.0, 0.4, 3)], 1e-5, "rdp")


def test_a_batch_skipped_under_cyclic_poisson_sampling_refuses_the_next_step():
    engine, module, optimizer, loader = _training(groups=2)
    batches = iter(loader)
    next(batches)                                                  # handed out, never stepped
    x, y = next(batches)
    with pytest.raises(PrivacyError, match="cyclic Poisson"):
        _step(module, optimizer, x, y)
