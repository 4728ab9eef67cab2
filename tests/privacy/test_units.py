"""The privacy unit as a strategy (dptrain.privacy.unit): `Unit(kind=...)` builds the registered
unit, which owns what differs between example and user level (its population, loader, clipper,
rules, resume fingerprint and ledger words), and reads back from every recorded plan."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dptrain
from dptrain.errors import ConfigError, PrivacyError
from dptrain.privacy.clipping import FlatClipper
from dptrain.privacy.plan import Clipping, Noise, PrivacyPlan, Selection, Unit
from dptrain.privacy.selection import LoaderContext
from dptrain.privacy.unit import (
    PRIVACY_UNIT,
    SHUFFLE_PRIVACY_UNIT,
    ExampleUnit,
    UserUnit,
    register_unit,
    unit_class,
    unit_kinds,
)
from dptrain.privacy.user_level import USER_PRIVACY_UNIT, UserLevelClipper

OLD_RUN = Path(__file__).parents[1] / "cli" / "data" / "run_folder_flat_privacy_keys"
USERS = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4]   # ten examples, five users


def _loader(n: int = len(USERS), batch_size: int = 2) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=gen), torch.zeros(n).long()),
                      batch_size=batch_size)


def _plan(unit: Unit, kind: str = "poisson") -> PrivacyPlan:
    return PrivacyPlan(selection=Selection(sample_rate=0.2, kind=kind), clipping=Clipping(),
                       noise=Noise(multiplier=1.0), delta=1e-5, unit=unit)


def _loader_rate(data_loader: DataLoader) -> tuple[int, float]:
    return len(data_loader.dataset), data_loader.batch_size / len(data_loader.dataset)


# -- the unit is its strategy ---------------------------------------------------------------------
def test_unit_of_kind_user_builds_the_user_strategy_and_the_default_the_example_one():
    assert type(Unit(kind="user")) is UserUnit
    assert type(Unit("user", 2)) is UserUnit and Unit("user", 2).max_examples_per_user == 2
    assert type(Unit()) is ExampleUnit and Unit() == ExampleUnit()
    assert unit_kinds() == ("example", "user")


def test_replacing_the_kind_changes_the_strategy_and_copies_keep_it():
    user = Unit("user", max_examples_per_user=3)
    example = dataclasses.replace(user, kind="example", max_examples_per_user=None)
    assert type(example) is ExampleUnit and example == Unit()
    for copied in (pickle.loads(pickle.dumps(user)), copy.copy(user), copy.deepcopy(user)):
        assert type(copied) is UserUnit and copied == user


def test_an_unknown_unit_is_a_config_error_naming_privacy_unit_and_the_known_units():
    with pytest.raises(ConfigError, match=r"privacy\.unit='person'.*example, user"):
        Unit("person")
    with pytest.raises(ConfigError, match=r"privacy\.unit\.kind='team'"):
        unit_class("team", "privacy.unit.kind")


def test_a_unit_kind_cannot_be_registered_twice():
    with pytest.raises(PrivacyError, match="'user' is already registered"):
        register_unit(UserUnit)


def test_the_cap_on_a_users_examples_belongs_to_user_level_only():
    with pytest.raises(ConfigError, match="privacy.unit=user"):
        Unit("example", max_examples_per_user=2)
    with pytest.raises(ConfigError, match="privacy.max_examples_per_user=0"):
        Unit("user", max_examples_per_user=0)


# -- the ledger's form ----------------------------------------------------------------------------
@pytest.mark.parametrize("unit", [Unit(), Unit("user"), Unit("user", max_examples_per_user=4)])
def test_a_unit_round_trips_through_the_plans_dict_unchanged_in_shape(unit):
    plan = _plan(unit)
    recorded = plan.to_dict()
    assert recorded["unit"] == {"kind": unit.kind,
                                "max_examples_per_user": unit.max_examples_per_user}
    back = PrivacyPlan.from_dict(json.loads(json.dumps(recorded)))
    assert back == plan and type(back.unit) is type(unit)


def test_an_old_ledgers_plan_reads_back_to_the_example_strategy():
    recorded = json.loads((OLD_RUN / "privacy_ledger.json").read_text())["plan"]
    assert recorded["unit"] == {"kind": "example", "max_examples_per_user": None}
    plan = PrivacyPlan.from_dict(recorded)
    assert type(plan.unit) is ExampleUnit
    assert plan.to_dict() == recorded


def test_a_plan_recorded_before_the_unit_was_reads_back_at_example_level():
    recorded = _plan(Unit()).to_dict()
    del recorded["unit"]
    assert type(PrivacyPlan.from_dict(recorded).unit) is ExampleUnit


def test_a_user_level_plan_recorded_by_the_kind_string_reads_back_to_the_user_strategy():
    recorded = _plan(Unit("user", max_examples_per_user=2)).to_dict()
    back = PrivacyPlan.from_dict(recorded)
    assert type(back.unit) is UserUnit and back.unit.max_examples_per_user == 2


# -- what each strategy owns ---------------------------------------------------------------------
def test_each_units_words_state_its_neighbouring_relation():
    poisson, shuffle = Selection(0.2), Selection(0.2, kind="shuffle")
    assert Unit().privacy_unit(poisson) == PRIVACY_UNIT and "add/remove" in PRIVACY_UNIT
    assert Unit().privacy_unit(shuffle) == SHUFFLE_PRIVACY_UNIT
    assert "substitution" in SHUFFLE_PRIVACY_UNIT
    assert Unit("user").privacy_unit(poisson) == USER_PRIVACY_UNIT
    assert USER_PRIVACY_UNIT.startswith("one user") and "add/remove" in USER_PRIVACY_UNIT


def test_user_level_refuses_a_selection_that_cannot_sample_users_example_level_does_not():
    with pytest.raises(ConfigError, match="privacy.sampling=poisson"):
        _plan(Unit("user"), kind="shuffle")
    assert _plan(Unit(), kind="shuffle").unit == Unit()


def test_each_unit_checks_makeprivate_data_for_it():
    Unit().check_data(None, distributed=True)
    with pytest.raises(ConfigError, match="privacy_unit='user'"):
        Unit().check_data(USERS, distributed=False)
    with pytest.raises(ConfigError, match="needs user_ids"):
        Unit("user").check_data(None, distributed=False)
    with pytest.raises(ConfigError, match="DistributedDataParallel"):
        Unit("user").check_data(USERS, distributed=True)


def test_the_population_counts_examples_or_users():
    loader = _loader()
    assert Unit().population(loader, None, _loader_rate) == (10, 0.2)
    assert Unit("user").population(loader, torch.tensor(USERS), _loader_rate) == (5, 0.4)
    assert not Unit("user").samples_examples and Unit().samples_examples


def test_the_command_lines_count_and_arguments_come_from_the_unit():
    dataset = _loader().dataset
    assert Unit().count(dataset) == (10, "training examples")
    assert Unit().data_arguments(dataset) == {}
    with pytest.raises(ConfigError, match="dataset.user_column"):
        Unit("user").data_arguments(dataset)
    dataset.user_ids = torch.tensor(USERS)
    assert Unit("user").count(dataset) == (5, "users")
    assert Unit("user").data_arguments(dataset)["user_ids"] is dataset.user_ids


def test_the_user_units_loader_clipper_fingerprint_and_ledger_entries():
    unit, selection = Unit("user", max_examples_per_user=2), Selection(0.4)
    loader = unit.private_loader(selection, _loader(), USERS, LoaderContext())
    assert loader.poisson_sampler.num_samples == 5
    assert unit.ledger_entries(loader) == {
        "num_users": 5, "max_examples_per_user": 2,
        "user_sampling": "poisson over users (ULS); a user's mean gradient is clipped"}
    fingerprint = unit.assignment_fingerprint(loader)
    assert fingerprint == loader.batch_sampler.assignment_fingerprint()
    moved = unit.private_loader(selection, _loader(), [1, *USERS[1:]], LoaderContext())
    assert unit.assignment_fingerprint(moved) != fingerprint  # one row changed user
    model = dptrain.GradSampleModule(torch.nn.Linear(3, 2))
    params = list(model.parameters())
    clipper = unit.clipper(FlatClipper(1.0), params, loader, model)
    assert isinstance(clipper, UserLevelClipper) and clipper.max_grad_norm == 1.0
    with pytest.raises(ConfigError, match="wrapped by dptrain"):
        unit.clipper(FlatClipper(1.0), params, loader, torch.nn.Linear(3, 2))


def test_the_example_units_loader_is_the_selections_and_nothing_else_is_added():
    unit, inner = Unit(), FlatClipper(1.0)
    loader = unit.private_loader(Selection(0.2, kind="shuffle"), _loader(), None, LoaderContext())
    assert type(loader).__name__ == "ShuffleDataLoader"
    assert unit.clipper(inner, [], loader, None) is inner
    assert unit.assignment_fingerprint(loader) is None and unit.ledger_entries(loader) == {}


def test_a_ledgers_unit_sentence_names_its_unit_kind():
    """How a sweep reads the unit of a ledger written before the plan was recorded."""
    from dptrain.privacy.unit import PRIVACY_UNIT, unit_described
    from dptrain.privacy.user_level import USER_PRIVACY_UNIT

    assert unit_described(USER_PRIVACY_UNIT) == "user"
    assert unit_described(PRIVACY_UNIT) == "example"
    assert unit_described("") == "example"
