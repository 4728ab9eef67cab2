"""The run folder's lock (dptrain.train.run_lock): one `train` per folder at a time, and the
temporaries of a killed writer cleared when the next run starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_trainer_support import make_job, make_settings

from dptrain.errors import ConfigError, RunFolderBusyError
from dptrain.train.loop import train
from dptrain.train.run_lock import hold_run_folder


def test_train_in_a_run_folder_held_elsewhere_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with hold_run_folder(tmp_path):
        with pytest.raises(RunFolderBusyError) as refused:
            train(make_job(private=True), make_settings(tmp_path, epochs=1))
    assert isinstance(refused.value, ConfigError)
    assert f"process {os.getpid()}" in str(refused.value)
    assert not (tmp_path / "privacy_ledger.json").exists()
    train(make_job(private=True), make_settings(tmp_path, epochs=1))   # released: it runs


def test_a_run_start_removes_the_temporaries_a_killed_write_left(tmp_path: Path) -> None:
    train(make_job(private=True), make_settings(tmp_path, epochs=2, max_steps=3))
    stale = [tmp_path / ".privacy_ledger.json.k1ll3d.tmp", tmp_path / ".metrics.jsonl.x2.tmp",
             tmp_path / "checkpoints" / ".last.pt.y3.tmp",
             tmp_path / "checkpoints" / ".last.pt.link.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    (tmp_path / ".notes").write_text("the user's")
    train(make_job(private=True), make_settings(tmp_path, epochs=2, resume="auto"))
    assert not [path for path in stale if path.exists()]
    assert (tmp_path / ".notes").read_text() == "the user's"
