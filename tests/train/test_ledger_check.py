"""A ledger's history against the run's other records (dptrain.train.ledger_check): a history cut
or edited consistently (its counts and epsilons recomputed, so that the ledger alone verifies) is
caught by every record that shows more steps or epsilon than the history; an untouched run
matches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_trainer_support import make_job, make_settings, rewrite_history

from dptrain.train.ledger import LEDGER_FILENAME, load_ledger, records_beyond_history, verify_ledger
from dptrain.train.loop import train
from dptrain.formatting import format_epsilon

STEPS_PER_EPOCH = 4  # 48 samples, batches of 12: the run takes 12 steps


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-epoch run keeping one epoch checkpoint: epoch_3.pt and last.pt at step 12
    are listed, the four entries of files gone (steps 4 and 8) are counted in pruned_checkpoints."""
    folder = tmp_path_factory.mktemp("run")
    train(make_job(), make_settings(folder, epochs=3, keep_checkpoints=1))
    return folder


def _copy(run_dir: Path, tmp_path: Path, *names: str) -> Path:
    """The ledger of `run_dir`, and the files `names` beside it, copied to `tmp_path`."""
    for name in (LEDGER_FILENAME, *names):
        shutil.copy(run_dir / name, tmp_path / name)
    return tmp_path


def _keep_checkpoint_entries_up_to(folder: Path, step: int) -> None:
    """Drop the ledger's checkpoint entries beyond `step`, as a forger who saw them would."""
    path = folder / LEDGER_FILENAME
    data = json.loads(path.read_text())
    data["checkpoints"] = [c for c in data["checkpoints"] if c["step"] <= step]
    path.write_text(json.dumps(data))


def test_an_untouched_run_matches_every_record_it_left(run_dir: Path) -> None:
    assert records_beyond_history(run_dir, load_ledger(run_dir)) == []
    result = verify_ledger(run_dir)
    assert result.ok and result.message == "matches" and result.records == []


def test_a_shortened_history_fails_verification_naming_the_checkpoint_entry_beyond_it(
        run_dir: Path, tmp_path: Path) -> None:
    rewrite_history(_copy(run_dir, tmp_path), steps=2 * STEPS_PER_EPOCH)
    result = verify_ledger(tmp_path)
    assert result.claimed == result.recomputed           # the ledger alone is consistent
    assert not result.ok and result.message.startswith("MISMATCH: checkpoint entry "
                                                       "checkpoints/epoch_3.pt: step 12")
    assert all("> history: 8 steps" in record for record in result.records)


def test_a_shortened_history_fails_verification_naming_the_metrics_line_beyond_it(
        run_dir: Path, tmp_path: Path) -> None:
    data = rewrite_history(_copy(run_dir, tmp_path, "metrics.jsonl"), steps=2 * STEPS_PER_EPOCH)
    _keep_checkpoint_entries_up_to(tmp_path, 2 * STEPS_PER_EPOCH)
    result = verify_ledger(tmp_path)
    assert not result.ok
    assert [record.split(",")[0] for record in result.records] == ["metrics.jsonl line 3: step 12"]
    assert f"epsilon {format_epsilon(data['epsilon'], 6)}" in result.records[0]


def test_a_shortened_history_fails_verification_naming_the_pruned_checkpoints_beyond_it(
        run_dir: Path, tmp_path: Path) -> None:
    rewrite_history(_copy(run_dir, tmp_path), steps=STEPS_PER_EPOCH)
    _keep_checkpoint_entries_up_to(tmp_path, STEPS_PER_EPOCH)
    result = verify_ledger(tmp_path)
    assert not result.ok
    assert [record.split(":")[0] for record in result.records] == ["pruned_checkpoints (4 entries)"]
    assert "step 8" in result.records[0]


def test_a_resume_beyond_the_history_fails_verification(run_dir: Path, tmp_path: Path) -> None:
    path = _copy(run_dir, tmp_path) / LEDGER_FILENAME
    data = json.loads(path.read_text())
    data["resumes"] = [{"checkpoint": "checkpoints/epoch_2.pt", "step": 8,
                        "discarded_committed_steps": 0, "charged_steps": 8, "time": "t"}]
    path.write_text(json.dumps(data))   # 8 steps + 8 charged: 16 steps, the history holds 12
    assert [r.split(":")[0] for r in verify_ledger(tmp_path).records] == [
        "resume 1 (step 8 + 8 charged steps)"]


def test_a_history_with_more_noise_than_the_run_used_fails_verification_by_its_epsilons(
        run_dir: Path, tmp_path: Path) -> None:
    rewrite_history(_copy(run_dir, tmp_path, "metrics.jsonl"), sigma=2.0)   # same 12 steps
    result = verify_ledger(tmp_path)
    assert not result.ok and result.claimed == result.recomputed
    assert "metrics.jsonl line 3: step 12, epsilon" in " ".join(result.records)


def test_a_non_private_ledger_has_no_history_to_check(tmp_path: Path) -> None:
    train(make_job(private=False), make_settings(tmp_path, epochs=1))
    assert records_beyond_history(tmp_path, load_ledger(tmp_path)) == []
