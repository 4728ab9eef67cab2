"""`dptrain` on an existing run folder: a refused attempt damages nothing already written."""

from __future__ import annotations

from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_in_process

RUN = ["train.epochs=1", "hardware=cpu", "hydra.run.dir=run", *QUIET]


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> Path:
    code, _, err = run_in_process(RUN, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    return tmp_path / "run"


def test_a_refused_resume_leaves_every_file_of_the_run_unchanged(
        finished_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = _files(finished_run)
    code, _, err = run_in_process([*RUN, "train.resume=auto", "optimizer.lr=0.3"],
                                  finished_run.parent, monkeypatch, capsys)
    assert code == 2 and "optimizer.lr" in err
    after = {p: b for p, b in _files(finished_run).items() if p.name != "main.log"}
    changed = {p for p in after if before.get(p) != after[p]}
    assert all("attempt_" in str(p) for p in changed), changed   # only the attempt's own record
    assert read_json(finished_run / "result.json")["status"] == "completed"


def test_a_new_run_into_a_used_folder_is_refused_and_keeps_its_result(
        finished_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    result = (finished_run / "result.json").read_bytes()
    config = (finished_run / ".hydra" / "config.yaml").read_bytes()
    code, _, err = run_in_process(RUN, finished_run.parent, monkeypatch, capsys)
    assert code == 2 and "train.resume=auto" in err
    assert (finished_run / "result.json").read_bytes() == result
    assert (finished_run / ".hydra" / "config.yaml").read_bytes() == config


def test_a_resumed_attempt_records_its_own_hydra_config_beside_the_original(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for extra in ("train.max_steps=3", "train.resume=auto"):
        code, _, err = run_in_process([*RUN, extra], tmp_path, monkeypatch, capsys)
        assert code == 0, err
    (attempt,) = (tmp_path / "run" / ".hydra").glob("attempt_*/overrides.yaml")
    assert "train.resume=auto" in attempt.read_text()
    assert "train.resume" not in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()


def test_resuming_a_completed_run_at_its_budget_is_a_no_op_not_an_error(
        finished_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    ledger = read_json(finished_run / "privacy_ledger.json")
    code, _, err = run_in_process([*RUN, "train.resume=auto"], finished_run.parent,
                                  monkeypatch, capsys)
    assert code == 0, err
    after = read_json(finished_run / "privacy_ledger.json")
    assert (after["status"], after["history"]) == ("completed", ledger["history"])


def test_privacy_sigma_with_a_target_epsilon_stops_at_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process(
        ["privacy=sigma", "privacy.noise_multiplier=2.0", "+privacy.target_epsilon=0.5",
         "train.epochs=20", "hardware=cpu", "hydra.run.dir=run", *QUIET],
        tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    assert ledger["status"] == "stopped_at_budget" and ledger["target"]["epsilon"] == 0.5
    assert 0 < ledger["epsilon"] <= 0.5


def test_a_resume_in_a_folder_whose_ledger_is_gone_is_refused_naming_the_folder_and_the_fix(
        finished_run: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = finished_run
    (run / "privacy_ledger.json").rename(run.parent / "privacy_ledger.json.aside")
    before = _files(run / "checkpoints")
    code, _, err = run_in_process([*RUN, "train.resume=auto"], run.parent, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    message = err.splitlines()[0]
    assert str(run) in message and "no privacy ledger" in message
    assert "Restore the ledger from a backup" in message and "new folder" in message
    assert not (run / "privacy_ledger.json").exists()
    assert _files(run / "checkpoints") == before
    assert read_json(run / "result.json")["status"] == "completed"
