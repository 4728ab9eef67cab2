"""Typed configs: a value of the wrong type or outside its rule stops `dptrain` with one paragraph
naming the key, the value and what the key accepts; Hydra's own multi-line blocks are replaced.

The cases run the real entry point in-process (fast); one runs the console command as a
subprocess for the exit status and the whole stderr.
"""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
from dptrain_runner import QUIET, run_dptrain, run_in_process
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from dptrain.train.ledger import same_config
from dptrain.cli.schema import SCHEMAS


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """stderr of `dptrain ARGS`, checked to be one dptrain paragraph (+ the -v note), exit 2."""

    def call(*args: str) -> str:
        code, out, err = run_in_process([*args, *QUIET], tmp_path, monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert code == 2, err
        assert len(lines) == 2 and lines[0].startswith("dptrain: error: "), err
        assert "run with -v" in lines[1]
        assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob(
            "metrics.jsonl"))
        return lines[0]

    return call


def test_a_bool_key_given_a_word_that_is_no_bool_is_refused(refused):
    line = refused("dataset.synthetic=maybe")
    assert "dataset.synthetic=maybe is not accepted" in line and "true or false" in line


def test_an_integer_key_given_a_word_is_refused_naming_the_rule(refused):
    line = refused("train.epochs=ten")
    assert "train.epochs=ten is not accepted" in line and "an integer >= 1" in line


def test_a_negative_clipping_norm_is_refused_naming_the_key_and_the_rule(refused):
    line = refused("privacy.max_grad_norm=-1")
    assert "privacy.max_grad_norm=-1" in line and "clipping norm > 0" in line


def test_a_float_key_given_a_word_is_refused(refused):
    line = refused("privacy.target_delta=abc")
    assert "privacy.target_delta=abc is not accepted" in line and "a number, or null" in line


def test_a_value_outside_a_keys_choices_is_refused_listing_them(refused):
    line = refused("privacy.accountant=moments")
    assert "privacy.accountant='moments'" in line and "one of gdp, prv, rdp" in line


def test_a_missing_group_option_is_one_paragraph_with_the_close_match(refused):
    line = refused("model=resnet1000")
    assert "did you mean model=resnet18" in line and "digits_mlp" in line
    assert "Config search path" not in line


def test_a_missing_key_is_one_paragraph_with_the_close_match(refused):
    line = refused("train.epoch=3")
    assert line == "dptrain: error: train.epoch is not a config key: did you mean train.epochs=3?"


def test_verbose_keeps_hydras_own_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(MissingConfigException, match="Could not find 'model/resnet1000'"):
        run_in_process(["-v", "model=resnet1000"], tmp_path, monkeypatch, capsys)


def test_the_command_prints_only_the_paragraph_and_exits_2(tmp_path):
    result = run_dptrain(["train.epochs=ten", *QUIET], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == (
        "dptrain: error: train.epochs=ten is not accepted: train.epochs takes an integer >= 1.")
    assert "full_key" not in result.stderr and "Traceback" not in result.stderr


def _option_files() -> list[tuple[str, str]]:
    root = resources.files("dptrain.conf")
    # logger: a list of options merged into one node (logger=[jsonl,tensorboard]), which one
    # option's schema would close to the others; its options are checked by the loggers.
    return [(group.name, option.name) for group in root.iterdir()
            if group.is_dir()
            and group.name not in ("hydra", "recipe", "logger", "finetune", "__pycache__")
            for option in group.iterdir() if option.name.endswith(".yaml")]


@pytest.mark.parametrize("group, option", _option_files())
def test_every_option_file_names_a_schema_with_exactly_its_keys(group, option):
    """The composed config (and so the config hash old runs resume with) is the yaml's alone."""
    text = resources.files("dptrain.conf").joinpath(group, option).read_text(encoding="utf-8")
    loaded = OmegaConf.to_container(OmegaConf.create(text))
    defaults = [d for d in loaded.pop("defaults") if d != "_self_"]
    # an option of the same group first (privacy/finetune: privacy/epsilon with other values)
    while isinstance(defaults[0], str) and not defaults[0].startswith("/"):
        base = resources.files("dptrain.conf").joinpath(group, f"{defaults[0]}.yaml")
        base = OmegaConf.to_container(OmegaConf.create(base.read_text(encoding="utf-8")))
        defaults = [d for d in base.pop("defaults") if d != "_self_"]
        loaded = {**base, **loaded}
    # then its schema; other entries select other groups' options (model=hf: the fine-tuning
    # defaults it brings)
    (schema_name,) = [d.lstrip("/") for d in defaults
                      if isinstance(d, str) and d.startswith("/schema_")]
    schema_group, schema = SCHEMAS[schema_name]
    assert schema_group == group
    assert {f.name for f in dataclasses.fields(schema)} == set(loaded)


def test_a_config_read_back_typed_is_the_same_run():
    untyped = {"optimizer": {"lr": 1}, "train": {"epochs": 3}}
    typed = {"optimizer": {"lr": 1.0}, "train": {"epochs": 3}}
    from dptrain.train.ledger import config_hash

    assert same_config(config_hash(untyped), untyped, typed)
    assert not same_config(config_hash(untyped), untyped, {**typed, "train": {"epochs": 4}})
