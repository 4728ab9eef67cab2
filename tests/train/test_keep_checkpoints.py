"""train.keep_checkpoints: only the newest k epoch checkpoints stay on disk (last.pt and best.pt
always); the ledger lists the files on disk and counts the others, and every step stays charged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_trainer_support import Killed, crash_at_call, make_job, make_settings

from dptrain.errors import PrivacyError
from dptrain.train.ledger import PrivacyLedger, load_ledger, verify_ledger
from dptrain.train.loop import train
from dptrain.train.settings import TrainSettings

STEPS_PER_EPOCH = 4  # 48 samples, batches of 12


def _on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("*.pt"))


def _existing(ledger: dict) -> list[str]:
    return sorted({Path(c["path"]).name for c in ledger["checkpoints"] if c["exists"]})


def test_the_newest_k_epoch_checkpoints_and_last_stay_and_the_ledger_says_which_exist(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=5, keep_checkpoints=2))
    ledger = load_ledger(tmp_path)
    assert _on_disk(tmp_path) == _existing(ledger) == ["epoch_4.pt", "epoch_5.pt", "last.pt"]


def test_the_ledger_lists_the_checkpoints_on_disk_and_counts_the_pruned_ones(
        tmp_path: Path) -> None:
    """10 files written (epoch_N.pt and last.pt each epoch): the 3 on disk are listed, the 7
    others (epoch_1..3.pt deleted, last.pt overwritten 4 times) counted with their largest step
    and epsilon, which the ledger's verification still checks the history against."""
    train(make_job(), make_settings(tmp_path, epochs=5, keep_checkpoints=2))   # the default
    ledger = load_ledger(tmp_path)
    listed = [(Path(c["path"]).name, c["step"], c["exists"]) for c in ledger["checkpoints"]]
    assert listed == [("epoch_4.pt", 16, True), ("epoch_5.pt", 20, True), ("last.pt", 20, True)]
    assert ledger["pruned_checkpoints"] == {
        "count": 7, "max_step": 4 * STEPS_PER_EPOCH,
        "max_epsilon": ledger["checkpoints"][0]["epsilon"]}   # epoch_4.pt's state: last.pt then


def test_keep_checkpoints_zero_keeps_last_and_best_only(tmp_path: Path) -> None:
    train(make_job(validation=True),
          make_settings(tmp_path, epochs=3, keep_checkpoints=0, keep_best=True))
    assert _on_disk(tmp_path) == _existing(load_ledger(tmp_path)) == ["best.pt", "last.pt"]


def test_keep_checkpoints_null_keeps_every_file(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3, keep_checkpoints=None))
    assert _on_disk(tmp_path) == ["epoch_1.pt", "epoch_2.pt", "epoch_3.pt", "last.pt"]


def test_the_default_keeps_two_epoch_checkpoints() -> None:
    assert TrainSettings(run_dir=Path("run"), epochs=1, batch_size=1).keep_checkpoints == 2


def test_deleting_old_checkpoints_leaves_a_resume_charged_exactly_as_keeping_them(
        tmp_path: Path) -> None:
    """A run killed in epoch 3 (fresh noise: a replayed step is a new release), resumed with
    train.resume=auto: with every file kept or only last.pt, the same steps stay charged."""
    ledgers = []
    for keep in (None, 0):
        run = tmp_path / str(keep)
        with pytest.raises(Killed):
            train(make_job(loss_fn=crash_at_call(2 * STEPS_PER_EPOCH + 3),
                           reproducible_mechanism=False),
                  make_settings(run, epochs=3, keep_checkpoints=keep))
        train(make_job(reproducible_mechanism=False),
              make_settings(run, epochs=3, keep_checkpoints=keep, resume="auto"))
        ledgers.append(load_ledger(run))
    assert _on_disk(tmp_path / "0") == ["last.pt"]
    assert ledgers[0]["history"] == ledgers[1]["history"]
    assert ledgers[0]["epsilon"] == ledgers[1]["epsilon"]
    charged = ledgers[1]["resumes"][-1]["charged_steps"]
    assert charged == STEPS_PER_EPOCH   # epoch 3's block, committed before the kill
    assert sum(run["steps"] for run in ledgers[1]["history"]) == 3 * STEPS_PER_EPOCH + charged


# -- a checkpoint written just before a kill, never recorded ---------------------------------------
def _killed_before_recording(epoch: int) -> Any:
    """PrivacyLedger.record_checkpoints that raises Killed instead of recording epoch_<epoch>.pt:
    the file (and last.pt, linked to it) is on disk, the ledger does not list it."""
    record = PrivacyLedger.record_checkpoints

    def maybe_kill(self: PrivacyLedger, paths: list[str], *args: Any, **kwargs: Any) -> None:
        if f"checkpoints/epoch_{epoch}.pt" in paths:
            raise Killed
        record(self, paths, *args, **kwargs)

    return maybe_kill


def test_checkpoints_written_just_before_kills_are_pruned_after_the_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed twice between writing an epoch checkpoint and recording it (epochs 2 and 4), resumed
    each time: with keep_checkpoints=2 only the newest two epoch files stay, and the ledger lists
    exactly the files on disk (the old code never pruned epoch_2.pt and epoch_4.pt)."""
    for kill in (2, 4):
        monkeypatch.setattr(PrivacyLedger, "record_checkpoints", _killed_before_recording(kill))
        with pytest.raises(Killed):
            train(make_job(), make_settings(tmp_path, epochs=7, keep_checkpoints=2,
                                            resume="auto"))
        assert f"epoch_{kill}.pt" in _on_disk(tmp_path)
        assert f"epoch_{kill}.pt" not in _existing(load_ledger(tmp_path))
    monkeypatch.undo()
    train(make_job(), make_settings(tmp_path, epochs=7, keep_checkpoints=2, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert _on_disk(tmp_path) == _existing(ledger) == ["epoch_6.pt", "epoch_7.pt", "last.pt"]
    assert verify_ledger(tmp_path).ok


def test_an_unrecorded_checkpoint_is_recorded_on_resume_and_the_run_resumes_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after writing epoch_3.pt (and last.pt) of a 3-epoch run, before recording them: the
    resume starts from that newest state (no step retaken), records the file at its step and
    epsilon (`found_on_resume`), and prunes the oldest epoch file, never the newest."""
    monkeypatch.setattr(PrivacyLedger, "record_checkpoints", _killed_before_recording(3))
    with pytest.raises(Killed):
        train(make_job(), make_settings(tmp_path, epochs=3, keep_checkpoints=2))
    monkeypatch.undo()
    before = load_ledger(tmp_path)
    assert _existing(before) == ["epoch_1.pt", "epoch_2.pt", "last.pt"]
    result = train(make_job(), make_settings(tmp_path, epochs=3, keep_checkpoints=2,
                                             resume="auto"))
    ledger = load_ledger(tmp_path)
    assert ledger["resumes"][-1]["step"] == 3 * STEPS_PER_EPOCH == result.steps
    found = [c for c in ledger["checkpoints"] if c.get("found_on_resume")]
    assert [(Path(c["path"]).name, c["step"], c["epoch"]) for c in found] == [
        ("epoch_3.pt", 12, 3)]
    assert found[0]["epsilon"] == pytest.approx(ledger["epsilon"], rel=1e-9)
    assert _on_disk(tmp_path) == _existing(ledger) == ["epoch_2.pt", "epoch_3.pt", "last.pt"]
    assert verify_ledger(tmp_path).ok


_KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
from test_trainer_support import make_job, make_settings
from dptrain.train.ledger import PrivacyLedger
from dptrain.train.loop import train

record = PrivacyLedger.record_checkpoints
def kill_before_recording(self, paths, *args, **kwargs):
    if "checkpoints/epoch_2.pt" in paths:
        os.kill(os.getpid(), signal.SIGKILL)
    record(self, paths, *args, **kwargs)
PrivacyLedger.record_checkpoints = kill_before_recording
train(make_job(), make_settings(Path(sys.argv[1]), epochs=4, keep_checkpoints=1))
"""


def test_a_process_sigkilled_between_writing_a_checkpoint_and_recording_it_resumes_and_prunes(
        tmp_path: Path) -> None:
    """A real SIGKILL (nothing of the process runs after it: the ledger still says "running")
    after epoch_2.pt is written, before it is recorded; the resumed run keeps one epoch file."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert load_ledger(tmp_path)["status"] == "running"
    assert _on_disk(tmp_path) == ["epoch_1.pt", "epoch_2.pt", "last.pt"]
    train(make_job(), make_settings(tmp_path, epochs=4, keep_checkpoints=1, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert ledger["resumes"][-1]["step"] == 2 * STEPS_PER_EPOCH
    assert _on_disk(tmp_path) == _existing(ledger) == ["epoch_4.pt", "last.pt"]
    assert verify_ledger(tmp_path).ok


def test_in_secure_mode_a_resume_behind_an_unrecorded_checkpoint_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Secure mode refuses to replay steps a checkpoint already holds; a checkpoint written just
    before a kill counts as written although its process never recorded it."""
    monkeypatch.setattr(PrivacyLedger, "record_checkpoints", _killed_before_recording(3))
    with pytest.raises(Killed):
        train(make_job(secure=True), make_settings(tmp_path, epochs=3))
    monkeypatch.undo()
    with pytest.raises(PrivacyError, match="secure_mode"):
        train(make_job(secure=True), make_settings(
            tmp_path, epochs=3, resume=str(tmp_path / "checkpoints" / "epoch_2.pt")))
