"""A run folder written before the run machinery moved to dptrain.train (by `dptrain
+recipe=digits_quick train.epochs=2 train.max_steps=30`, with the code of main at d6047c0)
resumes with today's code: the ledger format and the checkpoints are unchanged. Its config names
`privacy.reproducible_noise` (now `privacy.reproducible_mechanism`), and its Poisson sampling was
seeded from train.seed (now from OS entropy): the ledger keeps that flagged."""

from __future__ import annotations

import shutil
from pathlib import Path

from dptrain_runner import QUIET, read_json, run_in_process

from dptrain.train.ledger import EARLIER_REPRODUCIBLE_NOTE, load_ledger, same_config

OLD_RUN = Path(__file__).parent / "data" / "run_folder_before_the_train_package"
OVERRIDES = ["+recipe=digits_quick", "train.epochs=2"]


def _resume_old_run(tmp_path, monkeypatch, capsys) -> tuple[dict, dict]:
    """(the old ledger, the ledger after `train.resume=auto` ran the old run to its end)."""
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    before = read_json(run / "privacy_ledger.json")
    assert before["steps_completed"] == 30
    code, _, err = run_in_process([*OVERRIDES, *QUIET, "train.resume=auto",
                                   f"hydra.run.dir={run}"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    return before, load_ledger(run)


def test_an_old_run_folder_resumes_to_the_end_of_its_run(tmp_path, monkeypatch, capsys):
    before, ledger = _resume_old_run(tmp_path, monkeypatch, capsys)
    assert ledger["status"] == "completed" and ledger["steps_completed"] == 46
    assert same_config(before["config_hash"], before["config"], ledger["config"])
    assert [r["step"] for r in ledger["resumes"]] == [30]
    assert sum(run["steps"] for run in ledger["history"]) == 46
    assert ledger["epsilon"] > before["epsilon"]


def test_an_old_run_whose_sampling_was_seeded_from_train_seed_stays_flagged_reproducible(
        tmp_path, monkeypatch, capsys):
    before, ledger = _resume_old_run(tmp_path, monkeypatch, capsys)
    assert "randomness" not in before["mechanism"]
    assert before["config"]["privacy"]["reproducible_noise"] is False
    assert ledger["mechanism"]["randomness"] == "reproducible"
    assert ledger["mechanism"]["randomness_note"] == EARLIER_REPRODUCIBLE_NOTE


def test_an_old_run_folder_verifies_against_its_own_records_before_and_after_its_resume(
        tmp_path, monkeypatch, capsys):
    from dptrain.train.ledger import verify_ledger

    assert verify_ledger(OLD_RUN).records == []            # metrics.jsonl, result.json, entries
    _resume_old_run(tmp_path, monkeypatch, capsys)
    result = verify_ledger(tmp_path / "run")
    assert result.ok and result.records == [], result.message
