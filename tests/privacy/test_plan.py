"""The privacy plan: frozen, validated once, round-trips through the ledger's dict."""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.plan import Clipping, Noise, PrivacyPlan, Selection, Unit


def _plan(**overrides):
    values = dict(selection=Selection(sample_rate=0.1, kind="shuffle"),
                  clipping=Clipping(max_grad_norm=(1.0, 2.0), kind="per_layer"),
                  noise=Noise(multiplier=1.1, target_epsilon=4.0), accountant="rdp",
                  delta=1e-5, randomness="secure")
    values.update(overrides)
    return PrivacyPlan(**values)


@pytest.mark.parametrize("unit", [Unit(), Unit("user", max_examples_per_user=3)])
def test_a_plan_round_trips_through_its_dict(unit):
    plan = _plan(unit=unit, selection=Selection(sample_rate=0.1))
    assert PrivacyPlan.from_dict(plan.to_dict()) == plan


def test_a_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _plan().accountant = "prv"


@pytest.mark.parametrize("build, error, key", [
    (lambda: Selection(sample_rate=1.5), PrivacyError, "sample_rate"),
    (lambda: Selection(sample_rate=0.1, kind="cyclic"), ConfigError, "privacy.sampling"),
    (lambda: Clipping(max_grad_norm=0.0), PrivacyError, "max_grad_norm"),
    (lambda: Noise(), PrivacyError, "noise multiplier"),
    (lambda: _plan(accountant="magic"), PrivacyError, "accountant"),
    (lambda: _plan(delta=2.0), PrivacyError, "target_delta"),
    (lambda: _plan(clipping=Clipping(kind="adaptive")), ConfigError, "sampling=poisson"),
    (lambda: _plan(unit=Unit("user")), ConfigError, "privacy.sampling=poisson"),
    (lambda: Unit("example", max_examples_per_user=2), ConfigError, "privacy.unit=user"),
])
def test_an_unusable_plan_is_refused_naming_its_part(build, error, key):
    with pytest.raises(error, match=key):
        build()


def test_two_plans_differences_name_the_changed_part():
    assert _plan().differences(_plan(noise=Noise(multiplier=2.0))) == [
        "noise.multiplier: 1.1 != 2.0", "noise.target_epsilon: 4.0 != None"]


def test_make_private_keyword_arguments_build_the_engines_plan():
    model = torch.nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(40, 3), torch.randint(2, (40,))), batch_size=4)
    result = dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  data_loader=data, noise_multiplier=1.3, max_grad_norm=0.5,
                                  accountant="rdp", sampling="shuffle")
    plan = result.engine.plan
    assert (plan.selection.kind, plan.selection.sample_rate, plan.noise.multiplier,
            plan.clipping.max_grad_norm, plan.accountant, plan.delta) == ("shuffle", 0.1, 1.3, 0.5,
                                                                          "rdp", 1e-3)


def test_shuffled_training_puts_every_example_in_one_batch_per_epoch_and_charges_each_epoch():
    model = torch.nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.arange(10.).unsqueeze(1).repeat(1, 3),
                                    torch.zeros(10, dtype=torch.long)), batch_size=3)
    result = dptrain.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0,
                                  sampling="shuffle")
    seen = []
    for x, y in result.data_loader:
        seen += x[:, 0].tolist()
        torch.nn.functional.cross_entropy(result.module(x), y).backward()
        result.optimizer.step()
        result.optimizer.zero_grad()
    assert sorted(seen) == [float(i) for i in range(10)]
    one_epoch = dptrain.accounting.shuffle.shuffle_epsilon([(1.0, 0.3, 4)], 1e-5)
    assert result.engine.get_epsilon(1e-5) == pytest.approx(one_epoch)
