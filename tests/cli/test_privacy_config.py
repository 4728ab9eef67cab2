"""The command's privacy group -> the plan (cli/privacy_config.py): nested keys that mirror the
plan's parts, the older flat names read as aliases, and the crossings between the two.

Crossings tested (flat: the keys of dptrain 0.3, e.g. privacy.noise_multiplier; nested: e.g.
privacy.budget.sigma):

| crossing                    | started with                     | then                          | test |
|-----------------------------|----------------------------------|-------------------------------|------|
| resume                      | flat (a run folder of main c2c4040) | nested keys, train.resume=auto | test_a_run_started_with_flat_keys_by_the_previous_version_resumes_with_nested_keys |
| resume                      | nested                           | flat keys, train.resume=auto  | test_a_run_started_with_nested_keys_resumes_with_the_flat_keys |
| resume check (hashing)      | a recorded flat config           | its nested form               | test_a_recorded_flat_config_and_its_nested_form_are_the_same_run_for_a_resume |
| ledger verification         | a recorded flat config           | verify_ledger                 | test_a_ledger_written_with_flat_keys_still_verifies |
| sweep                       | -m privacy.budget.sigma=0.5,2.0  | one job per sigma             | test_a_sweep_over_the_nested_sigma_trains_each_job_with_its_sigma |
| tune (grid costs)           | privacy.budget.sigma=S           | privacy.noise_multiplier=S    | test_tune_plans_a_nested_grid_point_as_its_flat_spelling |
| user level                  | privacy.unit={kind:user,...}     | flat privacy.unit=user + cap  | test_user_level_nested_and_flat_build_the_same_plan, test_a_nested_user_level_run_records_its_cap |
| command line                | privacy.budget.sigma=S alone     | chooses privacy=sigma         | test_the_nested_sigma_alone_chooses_the_sigma_option |
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process
from hydra import compose, initialize_config_module

import dptrain.cli.resolvers  # noqa: F401  (the configs' ${dptrain.*:...} resolvers)
from dptrain.cli import privacy_config
from dptrain.cli.build import resolve_config
from dptrain.cli.overrides import choose_sigma_option
from dptrain.cli.privacy_config import PrivacyGroup, canonical_section
from dptrain.errors import ConfigError, DPTrainError, PrivacyError
from dptrain.privacy.plan import COMMAND_SELECTIONS
from dptrain.train.ledger import config_differences, config_hash, load_ledger

FLAT_RUN = Path(__file__).parent / "data" / "run_folder_flat_privacy_keys"
# the command that wrote FLAT_RUN (main at c2c4040), and the same settings in the nested keys
FLAT_COMMAND = ["+recipe=digits_quick", "privacy=sigma", "privacy.noise_multiplier=0.8",
                "privacy.sampling=poisson", "privacy.noise=independent", "privacy.unit=example",
                "privacy.target_delta=1e-6", "train.epochs=2"]
NESTED_COMMAND = ["+recipe=digits_quick", "privacy=sigma", "privacy.budget.sigma=0.8",
                  "privacy.sampling.kind=poisson", "privacy.noise.kind=independent",
                  "privacy.unit.kind=example", "privacy.budget.delta=1e-6", "train.epochs=2"]
TINY = ["hardware=cpu", *QUIET]

# older flat keys -> the nested section they mean (on top of privacy=sigma, sigma 1)
SIGMA = {"name": "sigma", "budget": {"sigma": 1.0}}
FLAT_AND_NESTED = [
    ({"name": "sigma", "noise_multiplier": 0.7}, {"name": "sigma", "budget": {"sigma": 0.7}}),
    ({"name": "epsilon", "target_epsilon": 2.0, "target_delta": 1e-6},
     {"name": "epsilon", "budget": {"target_epsilon": 2.0, "delta": 1e-6}}),
    ({**SIGMA, "sampling": "shuffle"}, {**SIGMA, "sampling": {"kind": "shuffle"}}),
    ({**SIGMA, "poisson_sampling": False}, {**SIGMA, "sampling": {"kind": "shuffle"}}),
    ({**SIGMA, "poisson_sampling": True}, SIGMA),
    ({**SIGMA, "sampling": "cyclic_poisson", "sampling_groups": 4},
     {**SIGMA, "sampling": {"kind": "cyclic_poisson", "groups": 4}}),
    ({**SIGMA, "noise": "banded", "noise_bands": 3}, {**SIGMA, "noise": {"kind": "banded", "bands": 3}}),
    ({**SIGMA, "noise": "blt", "noise_buffers": 2}, {**SIGMA, "noise": {"kind": "blt", "buffers": 2}}),
    ({**SIGMA, "unit": "user", "max_examples_per_user": 4},
     {**SIGMA, "unit": {"kind": "user", "max_examples_per_user": 4}}),
]


def _compose(*overrides: str) -> dict:
    """The resolved config `dptrain OVERRIDES` records (the privacy group nested)."""
    argv = ["dptrain", *overrides]
    choose_sigma_option(argv)
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        return resolve_config(compose("config", overrides=argv[1:]))


# ----------------------------------------------------------------------------- the sampling kinds
@pytest.mark.parametrize("kind", COMMAND_SELECTIONS)
def test_privacy_sampling_accepts_every_selection_kind_the_plan_offers_a_command(kind):
    assert privacy_config.sampling_kind(kind) == kind


def test_privacy_sampling_takes_its_choices_from_the_plan_not_a_list_of_its_own(monkeypatch):
    monkeypatch.setattr(privacy_config, "COMMAND_SELECTIONS", (*COMMAND_SELECTIONS, "new_kind"))
    assert privacy_config.sampling_kind("new_kind") == "new_kind"


def test_the_python_only_given_selection_is_refused_on_the_command_line_naming_the_key():
    with pytest.raises(ConfigError, match="privacy.sampling"):
        privacy_config.sampling_kind("given")


# ----------------------------------------------------------------------------- flat and nested
@pytest.mark.parametrize("flat, nested", FLAT_AND_NESTED)
def test_an_older_flat_name_builds_the_plan_of_its_nested_key(flat, nested):
    plans = [PrivacyGroup.parse(section).plan(0.05, 1e-5, steps=40) for section in (flat, nested)]
    assert plans[0].to_dict() == plans[1].to_dict()


@pytest.mark.parametrize("flat, nested", FLAT_AND_NESTED)
def test_an_older_flat_name_is_recorded_as_its_nested_key(flat, nested):
    assert canonical_section(flat) == canonical_section(nested)


def test_the_recorded_group_holds_no_older_name():
    section = _compose("privacy.noise_multiplier=0.5", "privacy.noise=banded",
                       "privacy.noise_bands=2", "privacy.target_delta=1e-6")["privacy"]
    assert not set(section) & set(privacy_config.ALIAS_KEYS)
    assert section["budget"] == {"sigma": 0.5, "target_epsilon": None, "delta": 1e-6}
    assert section["noise"] == {"kind": "banded", "bands": 2, "buffers": None}


def test_an_older_name_replaces_its_nested_key_left_at_the_options_default():
    # privacy=sigma gives budget.sigma 1.0; a recipe or command setting the flat name wins
    assert _compose("privacy=sigma", "privacy.noise_multiplier=0.25")["privacy"]["budget"][
        "sigma"] == 0.25


def test_an_older_name_that_disagrees_with_its_nested_key_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"privacy\.noise_bands=4 and privacy\.noise\.bands=3 "
                                          r"disagree"):
        _compose("privacy.noise.kind=banded", "privacy.noise.bands=3", "privacy.noise_bands=4")


def test_an_older_name_that_agrees_with_its_nested_key_is_accepted():
    section = _compose("privacy=sigma", "privacy.budget.sigma=0.5",
                       "privacy.noise_multiplier=0.5")["privacy"]
    assert section["budget"]["sigma"] == 0.5


def test_an_older_name_set_to_null_says_null_not_unset():
    # privacy=epsilon's target 3.0 must not come back: neither a target nor a sigma is refused
    with pytest.raises(PrivacyError, match="privacy.target_epsilon is null"):
        PrivacyGroup.parse(_compose_raw("privacy.target_epsilon=null"))


def _compose_raw(*overrides: str) -> dict:
    """The composed privacy group as the command resolves it, its older names still there."""
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        return resolve_config(compose("config", overrides=list(overrides)),
                              nested_privacy=False)["privacy"]


def test_a_part_given_whole_as_a_mapping_is_read_key_by_key():
    section = _compose("privacy.noise={kind:banded,bands:4}")["privacy"]
    assert section["noise"] == {"kind": "banded", "bands": 4, "buffers": None}


def test_a_misspelt_key_inside_a_part_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"privacy\.noise\.bandz.*Did you mean privacy\.noise\.bands"):
        PrivacyGroup.parse({**SIGMA, "noise": {"kind": "banded", "bandz": 4}})


@pytest.mark.parametrize("section, named", [
    ({**SIGMA, "noise": "banded"}, "privacy.noise_bands"),
    ({**SIGMA, "noise": {"kind": "banded"}}, r"privacy.noise.bands"),
    ({"name": "sigma", "noise_multiplier": -1.0}, "privacy.noise_multiplier"),
    ({"name": "sigma", "budget": {"sigma": -1.0}}, r"privacy.budget.sigma"),
])
def test_a_message_names_a_key_the_way_the_command_spelled_it(section, named):
    with pytest.raises(DPTrainError, match=named.replace(".", r"\.")):
        PrivacyGroup.parse(section)


def test_the_nested_defaults_the_aliases_give_way_to_are_the_yaml_defaults():
    for option in ("sigma", "epsilon"):
        section = _compose(f"privacy={option}")["privacy"]
        for part in privacy_config.PARTS:
            for key, value in section[part].items():
                assert privacy_config._nested_default(option, part, key) == value, (part, key)


# ----------------------------------------------------------------------------- the command line
def test_the_nested_sigma_alone_chooses_the_sigma_option():
    argv = ["dptrain", "privacy.budget.sigma=0.5"]
    choose_sigma_option(argv)
    assert argv == ["dptrain", "privacy=sigma", "privacy.budget.sigma=0.5"]
    assert _compose("privacy.budget.sigma=0.5") == _compose("privacy.noise_multiplier=0.5")


def test_the_nested_sigma_with_the_epsilon_option_is_refused():
    with pytest.raises(ConfigError, match="privacy.budget.sigma=0.5 gives sigma, but "
                                          "privacy=epsilon is chosen too"):
        choose_sigma_option(["dptrain", "privacy=epsilon", "privacy.budget.sigma=0.5"])


def test_a_sweep_over_the_nested_sigma_trains_each_job_with_its_sigma(tmp_path, monkeypatch,
                                                                       capsys):
    code, _, err = run_in_process(["-m", "privacy.budget.sigma=0.5,2.0", "hydra.sweep.dir=sweep",
                                   *TINY, "train.max_steps=1"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    sigmas = [[run["noise_multiplier"] for run in load_ledger(tmp_path / "sweep" / job)["history"]]
              for job in ("0", "1")]
    assert sigmas == [[0.5], [2.0]]


def test_tune_plans_a_nested_grid_point_as_its_flat_spelling():
    from dptrain.cli.tune import grid_costs

    nested, flat = grid_costs(["train.epochs=1"], [["privacy.budget.sigma=0.5"],
                                                   ["privacy.noise_multiplier=0.5"]])
    assert nested["history"] == flat["history"] and nested["history"][0]["noise_multiplier"] == 0.5


# ----------------------------------------------------------------------------- ledgers and resume
def test_a_recorded_flat_config_and_its_nested_form_are_the_same_run_for_a_resume():
    recorded = read_json(FLAT_RUN / "privacy_ledger.json")["config"]
    nested = {**recorded, "privacy": canonical_section(recorded["privacy"])}
    assert config_differences(recorded, nested) == []
    assert config_differences(nested, recorded) == []


def test_a_changed_setting_is_still_told_apart_under_its_other_name():
    recorded = read_json(FLAT_RUN / "privacy_ledger.json")["config"]
    nested = {**recorded, "privacy": canonical_section(recorded["privacy"])}
    nested["privacy"]["budget"] = {**nested["privacy"]["budget"], "delta": 1e-7}
    assert config_differences(recorded, nested) == ["privacy.budget.delta"]


def test_a_ledger_written_with_flat_keys_still_verifies():
    from dptrain.train.ledger import verify_ledger

    ledger = read_json(FLAT_RUN / "privacy_ledger.json")
    assert config_hash(ledger["config"]) == ledger["config_hash"]
    result = verify_ledger(FLAT_RUN)
    assert result.ok, result.message


def test_a_run_started_with_flat_keys_by_the_previous_version_resumes_with_nested_keys(
        tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(FLAT_RUN, run)
    code, _, err = run_in_process([*NESTED_COMMAND, *QUIET, "train.resume=auto",
                                   f"hydra.run.dir={run}"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = load_ledger(run)
    assert ledger["status"] == "completed" and [r["step"] for r in ledger["resumes"]] == [6]
    assert ledger["steps_completed"] > 6


def test_a_run_started_with_nested_keys_resumes_with_the_flat_keys(tmp_path, monkeypatch,
                                                                   capsys):
    code, _, err = run_in_process([*NESTED_COMMAND, *QUIET, "train.max_steps=3",
                                   "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    code, _, err = run_in_process([*FLAT_COMMAND, *QUIET, "train.max_steps=5",
                                   "train.resume=auto", "hydra.run.dir=run"], tmp_path,
                                  monkeypatch, capsys)
    assert code == 0, err
    ledger = load_ledger(tmp_path / "run")
    assert [r["step"] for r in ledger["resumes"]] == [3] and ledger["steps_completed"] == 5


# ----------------------------------------------------------------------------- user level
def test_user_level_nested_and_flat_build_the_same_plan():
    flat = PrivacyGroup.parse({**SIGMA, "unit": "user", "max_examples_per_user": 2})
    nested = PrivacyGroup.parse({**SIGMA, "unit": {"kind": "user", "max_examples_per_user": 2}})
    assert flat.unit == nested.unit and flat.unit.max_examples_per_user == 2
    assert flat.plan(0.1, 1e-5).to_dict() == nested.plan(0.1, 1e-5).to_dict()


def test_a_nested_user_level_run_records_its_cap(tmp_path, monkeypatch, capsys):
    from tests.hf_tiny import review_rows, save_tiny, write_csv

    save_tiny(tmp_path / "bert", "bert")
    write_csv(tmp_path / "train.csv", [{**row, "author": f"user{i % 9}"}
                                       for i, row in enumerate(review_rows(36))])
    code, _, err = run_in_process(
        [*QUIET, "model=hf", "model.name_or_path=./bert", "dataset=text",
         "dataset.train_file=train.csv", "dataset.text_column=review", "dataset.max_len=16",
         "dataset.user_column=author", "privacy.budget.sigma=1.0",
         "privacy.unit={kind:user,max_examples_per_user:2}", "train.epochs=1",
         "train.batch_size=3", "train.max_steps=1", "hydra.run.dir=run"],
        tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    assert ledger["mechanism"]["max_examples_per_user"] == 2
    assert ledger["config"]["privacy"]["unit"] == {"kind": "user", "max_examples_per_user": 2}
