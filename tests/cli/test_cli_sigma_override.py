"""`dptrain privacy.noise_multiplier=S` trains with sigma S (it chooses privacy=sigma); a sigma
that the chosen privacy option would not use is refused, never calibrated over."""

from __future__ import annotations

from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

from dptrain.cli.overrides import choose_sigma_option, open_mapping_keys
from dptrain.errors import ConfigError
from dptrain.train.ledger import load_ledger

TINY = ["train.max_steps=2", "hardware=cpu", *QUIET]


def _sigmas(run: Path) -> list[float]:
    return [entry["noise_multiplier"] for entry in load_ledger(run)["history"]]


@pytest.mark.parametrize("override", ["privacy.noise_multiplier=0.5", "+privacy.noise_multiplier=0.5"])
def test_a_noise_multiplier_on_its_own_trains_with_that_sigma(
        override: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process([override, "hydra.run.dir=run", *TINY], tmp_path, monkeypatch,
                                  capsys)
    assert code == 0, err
    assert _sigmas(tmp_path / "run") == [0.5]
    config = load_ledger(tmp_path / "run")["config"]["privacy"]
    assert config["name"] == "sigma" and "target_epsilon" not in config


def test_a_noise_multiplier_composes_as_the_explicit_sigma_option(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, alone, _ = run_in_process(["privacy.noise_multiplier=0.5", "--cfg", "job"], tmp_path,
                                 monkeypatch, capsys)
    _, explicit, _ = run_in_process(["privacy=sigma", "privacy.noise_multiplier=0.5", "--cfg", "job"],
                                    tmp_path, monkeypatch, capsys)
    assert alone == explicit and "noise_multiplier: 0.5" in alone


@pytest.mark.parametrize("option", ["epsilon", "none"])
def test_a_noise_multiplier_with_another_privacy_option_is_refused_in_one_paragraph(
        option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for override in ("privacy.noise_multiplier=0.5", "+privacy.noise_multiplier=0.5"):
        code, out, err = run_in_process([f"privacy={option}", override, "hydra.run.dir=run", *TINY],
                                        tmp_path, monkeypatch, capsys)
        assert code == 2 and not (tmp_path / "run").exists()
        assert err.startswith(f"dptrain: error: privacy.noise_multiplier=0.5 gives sigma, but "
                              f"privacy={option} is chosen too")
        assert "drop privacy=" in err and "Traceback" not in err and "To append" not in err + out


def test_a_sweep_over_noise_multipliers_trains_each_job_with_its_sigma(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process(["-m", "privacy.noise_multiplier=0.5,2.0",
                                   "hydra.sweep.dir=sweep", *TINY, "train.max_steps=1"],
                                  tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert [_sigmas(tmp_path / "sweep" / job) for job in ("0", "1")] == [[0.5], [2.0]]
    rows = read_json(tmp_path / "sweep" / "sweep_summary.json")["jobs"]
    assert [r["status"] for r in rows] == ["completed", "completed"]


def test_the_rewrite_inserts_privacy_sigma_once_before_the_first_sigma() -> None:
    argv = ["dptrain", "-m", "+privacy.noise_multiplier=0.5,1", "train.epochs=2"]
    choose_sigma_option(argv)
    assert argv == ["dptrain", "-m", "privacy=sigma", "privacy.noise_multiplier=0.5,1",
                    "train.epochs=2"]


def test_the_rewrite_keeps_an_explicit_sigma_option_and_leaves_other_commands_alone() -> None:
    argv = ["dptrain", "privacy=sigma", "++privacy.noise_multiplier=2"]
    choose_sigma_option(argv)
    assert argv == ["dptrain", "privacy=sigma", "privacy.noise_multiplier=2"]
    for untouched in (["dptrain", "privacy=epsilon", "privacy.target_epsilon=1"],
                      ["dptrain", "~privacy.noise_multiplier", "--cfg", "job"]):
        argv = list(untouched)
        choose_sigma_option(argv)
        assert argv == untouched


def test_a_sweep_mixing_privacy_options_with_a_sigma_is_refused() -> None:
    with pytest.raises(ConfigError, match="privacy=epsilon is chosen too"):
        choose_sigma_option(["dptrain", "-m", "privacy=epsilon,sigma", "privacy.noise_multiplier=1"])


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_dotted_lora_key_sets_or_adds_the_setting_with_or_without_plus(prefix: str) -> None:
    argv = ["dptrain", "model=hf", f"{prefix}model.lora.r=4", "train.epochs=1"]
    open_mapping_keys(argv)
    assert argv == ["dptrain", "model=hf", "++model.lora.r=4", "train.epochs=1"]


def test_dotted_lora_keys_compose_into_the_lora_mapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process(["model=hf", "model.name_or_path=x", "model.lora.r=4",
                                     "model.lora.target_modules=[query,value]", "--cfg", "job"],
                                    tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "lora:\n    r: 4\n    target_modules:\n    - query\n    - value" in out


def test_a_dotted_lora_key_overrides_one_setting_of_a_recipe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_in_process(["+recipe=sst2_roberta_lora", "+model.lora.r=4", "--cfg",
                                     "job"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "lora:\n    r: 4\n    alpha:" in out
