"""The ledger of a cyclic Poisson run: its plan's groups and its charge (sensitivity,
participation schema) are recorded, `dptrain-ledger` recomputes the epsilon from them, and a
resume that would shift its steps against their groups is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_support import Killed, crash_at_call, final_weights, make_job, make_settings

from dptrain.accounting import compute_epsilon
from dptrain.accounting.events import AccountingEvent
from dptrain.errors import ConfigError
from dptrain.train.ledger import history_from_json, load_ledger, verify_ledger
from dptrain.train.loop import train

CYCLIC = {"sampling": "cyclic_poisson", "sampling_groups": 3}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cyclic")
    train(make_job(engine_kwargs=CYCLIC), make_settings(folder, epochs=2))
    return folder


def _edited(run_dir: Path, tmp_path: Path, edit) -> Path:
    data = json.loads((run_dir / "privacy_ledger.json").read_text())
    edit(data)
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(data))
    return tmp_path


def test_the_ledger_records_the_groups_and_the_amplified_charge(run_dir: Path) -> None:
    data = load_ledger(run_dir)
    steps = sum(run["steps"] for run in data["history"])
    assert data["plan"]["selection"]["kind"] == "cyclic_poisson"
    assert data["plan"]["selection"]["groups"] == 3
    assert data["accounting"] == {
        "selection": "cyclic_poisson", "groups": 3, "relation": "add/remove", "amplified": True,
        "sensitivity": 1.0,
        "participation": {"kind": "cyclic_poisson", "groups": 3, "rounds": -(-steps // 3)}}


def test_the_verifier_recomputes_the_epsilon_of_the_groups_rounds(run_dir: Path) -> None:
    data = load_ledger(run_dir)
    history = history_from_json(data["history"])
    result = verify_ledger(run_dir)
    expected = compute_epsilon(history, data["delta"], "rdp",
                               AccountingEvent("cyclic_poisson", 3))
    assert result.ok and result.recomputed == expected == data["epsilon"]
    assert expected != compute_epsilon(history, data["delta"], "rdp")   # not Poisson's


def test_a_ledger_whose_groups_were_edited_fails_verification(run_dir: Path,
                                                              tmp_path: Path) -> None:
    def fewer_groups(data):
        data["plan"]["selection"]["groups"] = 2
    result = verify_ledger(_edited(run_dir, tmp_path, fewer_groups))
    assert not result.ok and "MISMATCH" in result.message


def test_a_ledger_whose_recorded_sensitivity_was_edited_fails_verification(
        run_dir: Path, tmp_path: Path) -> None:
    def smaller(data):
        data["accounting"]["sensitivity"] = 0.5
    result = verify_ledger(_edited(run_dir, tmp_path, smaller))
    assert not result.ok and "accounting" in result.message


def test_a_resume_that_would_charge_steps_out_of_their_groups_is_refused(tmp_path: Path) -> None:
    job = make_job(engine_kwargs=CYCLIC, reproducible_mechanism=False,
                   loss_fn=crash_at_call(6))
    with pytest.raises(Killed):
        train(job, make_settings(tmp_path, epochs=3))
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(ConfigError, match="sampling group"):
        train(make_job(engine_kwargs=CYCLIC, reproducible_mechanism=False),
              make_settings(tmp_path, epochs=3, resume="auto"))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


def test_a_cyclic_run_resumed_from_a_checkpoint_replays_its_groups_exactly(tmp_path: Path) -> None:
    whole = make_job(engine_kwargs=CYCLIC)
    train(whole, make_settings(tmp_path / "whole", epochs=3))
    train(make_job(engine_kwargs=CYCLIC), make_settings(tmp_path / "resumed", epochs=3))
    resumed = make_job(engine_kwargs=CYCLIC)
    train(resumed, make_settings(tmp_path / "resumed", epochs=3,
                                 resume=str(tmp_path / "resumed" / "checkpoints" / "epoch_1.pt")))
    assert all(torch.equal(a, b) for a, b in zip(final_weights(resumed).values(),
                                                 final_weights(whole).values()))
    assert load_ledger(tmp_path / "resumed")["history"] == load_ledger(tmp_path / "whole")["history"]
