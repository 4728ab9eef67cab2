"""The privacy ledger file: schema, atomic writes, refusal of corrupt files, the verifier CLI."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from test_trainer_support import make_job, make_settings, tiny_config, tiny_data

from dptrain.data.fingerprint import data_fingerprint
from dptrain.train.ledger import (
    EARLIER_REPRODUCIBLE_NOTE,
    LEDGER_SCHEMA,
    PrivacyLedger,
    carry_randomness,
    config_differences,
    config_hash,
    load_ledger,
    merge_history,
    schema_errors,
)
from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.train.loop import train
from dptrain.errors import ConfigError


def _non_private_ledger(run_dir: Path) -> PrivacyLedger:
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = PrivacyLedger.create(run_dir, config=tiny_config(), dataset_name="tiny",
                                  dataset_size=48, mechanism=None, accountant=None,
                                  target_epsilon=None, delta=None)
    ledger.write()
    return ledger


@pytest.mark.parametrize("private", [True, False])
def test_written_ledger_validates_against_the_json_schema(tmp_path: Path, private: bool) -> None:
    train(make_job(private=private), make_settings(tmp_path, epochs=2, max_steps=5))
    train(make_job(private=private), make_settings(tmp_path, epochs=2, resume="auto"))
    data = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert data["resumes"] and data["checkpoints"]
    jsonschema.validate(data, LEDGER_SCHEMA)
    assert schema_errors(data) == []


def test_schema_checker_reports_a_wrong_status() -> None:
    data = {"status": "finished"}
    errors = schema_errors(data)
    assert any("status" in e and "finished" in e for e in errors)


def test_schema_checker_agrees_with_jsonschema_on_a_missing_key(tmp_path: Path) -> None:
    data = _non_private_ledger(tmp_path).data
    del data["history"]
    assert any("history" in e for e in schema_errors(data))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(json.dumps(data)), LEDGER_SCHEMA)


def test_truncated_ledger_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    _non_private_ledger(tmp_path)
    path = tmp_path / "privacy_ledger.json"
    path.write_text(path.read_text()[:50])
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        load_ledger(path)


def test_a_corrupt_ledger_is_to_be_restored_not_moved_aside_since_its_steps_are_spent(
        tmp_path: Path) -> None:
    _non_private_ledger(tmp_path)
    path = tmp_path / "privacy_ledger.json"
    path.write_text(path.read_text()[:50])
    with pytest.raises(ConfigError) as refused:
        load_ledger(path)
    message = str(refused.value)
    assert "Restore it from a backup" in message and "new folder" in message
    assert "steps it recorded are spent" in message and "re-run" not in message


def test_edited_config_breaks_the_ledger_hash(tmp_path: Path) -> None:
    _non_private_ledger(tmp_path)
    path = tmp_path / "privacy_ledger.json"
    data = json.loads(path.read_text())
    data["config"]["optimizer"]["lr"] = 9.0
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="config_hash"):
        load_ledger(path)


def test_ledger_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    ledger = _non_private_ledger(tmp_path)
    ledger.write()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["privacy_ledger.json"]


def test_a_ledger_listing_every_checkpoint_written_verifies_and_a_resume_folds_the_gone_ones(
        tmp_path: Path) -> None:
    """A ledger written before pruned entries were counted kept each one (`exists: false`)."""
    train(make_job(), make_settings(tmp_path, epochs=2))   # epoch_1.pt, epoch_2.pt, last.pt
    path = tmp_path / "privacy_ledger.json"
    data = json.loads(path.read_text())
    del data["pruned_checkpoints"]                          # last.pt at step 4, overwritten
    data["checkpoints"].insert(1, {**data["checkpoints"][0], "path": "checkpoints/last.pt",
                                   "exists": False})
    path.write_text(json.dumps(data))
    assert ledger_main([str(tmp_path)]) == 0
    train(make_job(), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert [Path(c["path"]).name for c in ledger["checkpoints"]] == [
        "epoch_1.pt", "epoch_2.pt", "epoch_3.pt", "last.pt"]
    assert ledger["pruned_checkpoints"]["count"] == 2       # last.pt at steps 4 and 8
    assert ledger["pruned_checkpoints"]["max_step"] == 8


def test_merge_history_joins_identical_adjacent_runs_and_drops_empty_ones() -> None:
    runs = [(1.0, 0.1, 2), (1.0, 0.1, 3), (2.0, 0.1, 0), (2.0, 0.1, 1), (1.0, 0.1, 1)]
    assert merge_history(runs) == [(1.0, 0.1, 5), (2.0, 0.1, 1), (1.0, 0.1, 1)]


def test_ledger_cmd_exits_2_on_a_missing_path(tmp_path: Path) -> None:
    assert ledger_main([str(tmp_path / "missing")]) == 2


def test_ledger_cmd_accepts_a_non_private_ledger(tmp_path: Path) -> None:
    _non_private_ledger(tmp_path)
    assert ledger_main([str(tmp_path), "--json"]) == 0


def test_ledger_cmd_fails_on_a_corrupt_ledger_in_a_sweep(tmp_path: Path) -> None:
    _non_private_ledger(tmp_path / "job0")
    _non_private_ledger(tmp_path / "job1")
    (tmp_path / "job1" / "privacy_ledger.json").write_text("{")
    assert ledger_main([str(tmp_path)]) == 1


def test_a_ledger_keeping_the_best_checkpoint_says_the_choice_is_not_covered_by_epsilon(
        tmp_path: Path) -> None:
    train(make_job(validation=True), make_settings(tmp_path, epochs=2, keep_best=True))
    data = json.loads((tmp_path / "privacy_ledger.json").read_text())
    jsonschema.validate(data, LEDGER_SCHEMA)
    selection = data["model_selection"]
    assert selection["checkpoint"] == "checkpoints/best.pt"
    assert selection["covered_by_epsilon"] is False and selection["validation_size"] == 16
    assert "not this choice" in selection["note"]
    assert data["dataset"] == {"name": "tiny", "size": 48, "validation_size": 16,
                               "private_preprocessing": [], "synthetic": False,
                               "fingerprints": [data_fingerprint(tiny_data()[0])]}


def test_a_ledger_without_best_checkpoint_selection_has_none(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=1))
    assert load_ledger(tmp_path)["model_selection"] is None


def _privacy(**keys: bool) -> dict:
    return {"privacy": {"name": "sigma", "noise_multiplier": 1.0, **keys}}


def test_a_config_recorded_before_optimizer_head_lr_is_the_same_run_with_it_null() -> None:
    old = {"optimizer": {"_target_": "torch.optim.AdamW", "lr": 2e-3}}
    new = {"optimizer": {**old["optimizer"], "head_lr": None}}
    assert config_hash(old) == config_hash(new) and config_differences(old, new) == []
    head = {"optimizer": {**old["optimizer"], "head_lr": 1e-2}}
    assert config_differences(old, head) == ["optimizer.head_lr"]


def test_a_config_recorded_before_model_pooling_is_the_run_with_the_classes_own_head() -> None:
    old = {"model": {"name_or_path": "./minilm"}}
    own_head = {"model": {**old["model"], "pooling": "model"}}
    assert config_hash(old) == config_hash(own_head) and config_differences(old, own_head) == []
    auto = {"model": {**old["model"], "pooling": "auto"}}
    assert config_differences(old, auto) == ["model.pooling"]


def test_a_recorded_reproducible_noise_is_compared_as_reproducible_mechanism() -> None:
    old = _privacy(reproducible_noise=False)
    assert config_differences(old, _privacy(reproducible_mechanism=False)) == []
    assert config_differences(old, _privacy(reproducible_mechanism=True)) == [
        "privacy.reproducible_mechanism"]


NESTED_SIGMA = {"name": "sigma", "budget": {"sigma": 1.0, "target_epsilon": None, "delta": None},
                "sampling": {"kind": None, "groups": None},
                "noise": {"kind": "independent", "bands": None, "buffers": None},
                "unit": {"kind": "example", "max_examples_per_user": None}}


def _nested(**parts: dict) -> dict:
    return {"privacy": {**NESTED_SIGMA, **{part: {**NESTED_SIGMA[part], **keys}
                                           for part, keys in parts.items()}}}


@pytest.mark.parametrize("flat, nested", [
    ({}, {}),
    ({"target_delta": 1e-6}, {"budget": {"delta": 1e-6}}),
    ({"noise": "banded", "noise_bands": 4}, {"noise": {"kind": "banded", "bands": 4}}),
    ({"sampling": "cyclic_poisson", "sampling_groups": 3},
     {"sampling": {"kind": "cyclic_poisson", "groups": 3}}),
    ({"poisson_sampling": False}, {"sampling": {"kind": "shuffle"}}),
    ({"poisson_sampling": True, "unit": "user", "max_examples_per_user": 2},
     {"unit": {"kind": "user", "max_examples_per_user": 2}}),
])
def test_a_recorded_flat_privacy_group_is_the_same_run_as_its_nested_form(flat, nested) -> None:
    assert config_differences(_privacy(**flat), _nested(**nested)) == []


def test_a_nested_privacy_key_that_changed_is_told_apart_from_its_recorded_flat_name() -> None:
    assert config_differences(_privacy(noise="banded", noise_bands=4),
                              _nested(noise={"kind": "banded", "bands": 5})) == [
        "privacy.noise.bands"]
    assert config_differences(_privacy(poisson_sampling=False), _nested()) == [
        "privacy.sampling.kind"]


def test_a_resume_keeps_a_run_flagged_whose_earlier_sampling_was_seeded() -> None:
    mechanism = {"secure_mode": False, "randomness": "os_entropy"}
    carry_randomness({"secure_mode": False}, mechanism)  # a ledger from before `randomness`
    assert mechanism["randomness"] == "reproducible"
    assert mechanism["randomness_note"] == EARLIER_REPRODUCIBLE_NOTE


@pytest.mark.parametrize("previous", [{"secure_mode": True}, {"randomness": "os_entropy"}])
def test_a_resume_flags_nothing_when_no_earlier_draw_was_seeded(previous: dict) -> None:
    mechanism = {"secure_mode": False, "randomness": "os_entropy"}
    carry_randomness(previous, mechanism)
    assert mechanism == {"secure_mode": False, "randomness": "os_entropy"}
