"""A full disk through the `dptrain` command: one paragraph naming the file, what the ledger
charges and the command that resumes; the ledger stays valid and the run resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dptrain_runner import QUIET, run_in_process

from dptrain.accounting.history import history_steps
from dptrain.formatting import format_epsilon
from dptrain.train.ledger import history_from_json, load_ledger

RUN = ["train.epochs=3", "hardware=cpu", "hydra.run.dir=run", *QUIET,
       "privacy.reproducible_mechanism=true"]   # an exact replay: the resume retakes steps once
# `dptrain` on a disk that fills up when the file named by $FULL_AT (the start of its temporary's
# name) is written: its fsync fails with ENOSPC, as a real full disk's write or flush does.
FULL_DISK_ENTRY = """import errno, os
real_fsync = os.fsync
def fsync(fd):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    if name.startswith(os.environ["FULL_AT"]):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fsync(fd)
os.fsync = fsync
from dptrain.cli.main import main
main()
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")
def test_a_full_disk_stops_the_run_with_one_paragraph_and_a_ledger_it_resumes_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FULL_AT": ".epoch_2.pt."}
    full = subprocess.run([sys.executable, "-c", FULL_DISK_ENTRY, *RUN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert full.returncode != 0
    assert "Traceback" not in full.stderr
    paragraph = full.stderr.splitlines()[0]
    ledger = load_ledger(tmp_path / "run")                 # valid, and says the run failed
    assert ledger["status"] == "failed" and ledger["steps_completed"] == 24
    charged = history_steps(history_from_json(ledger["history"]))
    assert "epoch_2.pt" in paragraph and "No space left on device" in paragraph
    assert "stopped after 24 steps" in paragraph
    assert f"charges {charged} steps, epsilon {format_epsilon(ledger['epsilon'])}" in paragraph
    assert "hydra.run.dir=run train.resume=auto" in paragraph
    assert not list((tmp_path / "run" / "checkpoints").glob(".*.tmp"))

    code, _, err = run_in_process([*RUN, "train.resume=auto"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    ledger = load_ledger(tmp_path / "run")
    assert ledger["status"] == "completed" and ledger["steps_completed"] == 36


# `dptrain` on a disk that is full from the start: Hydra's write of the run folder's
# .hydra/config.yaml (before any job runs) fails with ENOSPC.
FULL_FROM_START_ENTRY = """import builtins, errno, os
real_open = builtins.open
def open_(file, mode="r", *args, **kwargs):
    if "w" in mode and str(file).endswith("config.yaml"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return real_open(file, mode, *args, **kwargs)
builtins.open = open_
from dptrain.cli.main import main
main()
"""


def test_a_disk_full_at_start_up_stops_with_one_paragraph_naming_the_folder_key(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = subprocess.run([sys.executable, "-c", FULL_FROM_START_ENTRY, *RUN], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert full.returncode == 2
    assert "Traceback" not in full.stderr
    paragraph = full.stderr.splitlines()[0]
    assert "config.yaml" in paragraph and "No space left on device" in paragraph
    assert "hydra.run.dir" in paragraph and "nothing charged" in paragraph
    assert not (tmp_path / "run" / "privacy_ledger.json").exists()
