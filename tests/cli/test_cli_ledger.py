"""`dptrain-ledger` on the run folder of a real `dptrain` run: an untouched run matches; a ledger
whose history was shortened consistently (counts and epsilons recomputed) is a MISMATCH naming
each record of the run that shows more steps: checkpoint entries, metrics.jsonl, result.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dptrain_runner import QUIET, read_json, run_once_in_process

from dptrain.cli.ledger_cmd import main as ledger_main
from tests.train.test_trainer_support import rewrite_history

STEPS_PER_EPOCH = 12   # digits, the default batch size


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-epoch digits run with the default checkpoint settings (one run for the module)."""
    cwd = tmp_path_factory.mktemp("cli_ledger")
    code, _, err = run_once_in_process(["privacy=sigma", "train.epochs=4", "hardware=cpu",
                                        "hydra.run.dir=run", *QUIET], cwd)
    assert code == 0, err
    return cwd / "run"


def _ledger_json(paths: list[Path], capsys: pytest.CaptureFixture[str]) -> tuple[int, list]:
    capsys.readouterr()
    code = ledger_main([*map(str, paths), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_default_run_lists_its_checkpoints_on_disk_and_counts_the_pruned_ones(
        run_dir: Path) -> None:
    ledger = read_json(run_dir / "privacy_ledger.json")
    assert [c["path"] for c in ledger["checkpoints"]] == [
        "checkpoints/epoch_3.pt", "checkpoints/epoch_4.pt", "checkpoints/last.pt"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "epoch_3.pt", "epoch_4.pt", "last.pt"]
    assert ledger["pruned_checkpoints"]["count"] == 5      # epoch_1.pt, epoch_2.pt, last.pt x3
    assert ledger["pruned_checkpoints"]["max_step"] == 3 * STEPS_PER_EPOCH


def test_an_untouched_run_folder_matches(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = _ledger_json([run_dir], capsys)
    assert code == 0 and rows[0]["message"] == "matches" and rows[0]["records"] == []


def test_a_consistently_shortened_ledger_is_a_mismatch_naming_every_record_beyond_it(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edited = tmp_path / "run"
    shutil.copytree(run_dir, edited)
    rewrite_history(edited, steps=2 * STEPS_PER_EPOCH)      # 48 steps taken, 24 left
    code, rows = _ledger_json([edited], capsys)
    assert code == 1 and rows[0]["claimed"] == rows[0]["recomputed"]
    assert rows[0]["message"].startswith("MISMATCH: checkpoint entry checkpoints/epoch_3.pt")
    named = [record.split(": step")[0] for record in rows[0]["records"]]
    assert named == ["checkpoint entry checkpoints/epoch_3.pt",
                     "checkpoint entry checkpoints/epoch_4.pt",
                     "checkpoint entry checkpoints/last.pt",
                     "pruned_checkpoints (5 entries)", "metrics.jsonl line 3",
                     "metrics.jsonl line 4", "result.json"]
    assert "result.json: step 48, epsilon" in rows[0]["records"][-1]
    assert all("> history: 24 steps" in record for record in rows[0]["records"])


@pytest.mark.parametrize("override", ["privacy.sampling=shuffle", "privacy.poisson_sampling=false"])
def test_a_shuffled_run_trains_records_its_plan_and_verifies(
        override: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from dptrain.accounting.shuffle import shuffle_epsilon
    from dptrain_runner import run_in_process

    code, _, err = run_in_process(["privacy=sigma", override, "train.epochs=2", "hardware=cpu",
                                   "hydra.run.dir=run", *QUIET], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = read_json(tmp_path / "run" / "privacy_ledger.json")
    assert (ledger["schema_version"], ledger["plan"]["selection"]["kind"],
            ledger["mechanism"]["sampling"]) == (2, "shuffle", "shuffle")
    assert "substitution" in ledger["mechanism"]["privacy_unit"]
    run = ledger["history"][0]
    assert float(ledger["epsilon"]) == shuffle_epsilon(
        [(run["noise_multiplier"], run["sample_rate"], run["steps"])], ledger["delta"])
    assert ledger_main([str(tmp_path / "run")]) == 0
