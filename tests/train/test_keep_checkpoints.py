"""train.keep_checkpoints: only the newest k epoch checkpoints stay on disk (last.pt and best.pt
always); the ledger lists the files on disk and counts the others, and every step stays charged."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_support import Killed, crash_at_call, make_job, make_settings

from dptrain.train.ledger import load_ledger
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
