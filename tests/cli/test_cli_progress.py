"""What `dptrain` prints when its output is not a terminal (a log file, a cluster job)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dptrain_runner import read_json, run_in_process

EPOCH_LINE = re.compile(r"\[dptrain\.train\]\[INFO\] - epoch (\d)/2: private \(not covered by "
                        r"epsilon\): loss [0-9.]+, accuracy [0-9.]+%; test accuracy [0-9.]+%, "
                        r"epsilon so far [0-9.]+, [0-9.]+ s$",
                        flags=re.M)


def test_without_a_terminal_each_epoch_prints_one_line_to_the_console_and_to_main_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_in_process(["train.epochs=2", "hardware=cpu", "hydra.run.dir=run"],
                                    tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert EPOCH_LINE.findall(out) == ["1", "2"]
    assert EPOCH_LINE.findall((tmp_path / "run" / "main.log").read_text()) == ["1", "2"]


def test_a_synthetic_run_is_flagged_in_the_summary_and_the_ledger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_in_process(["dataset.synthetic=true", "train.max_steps=1",
                                     "hydra.run.dir=run"], tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert re.search(r"│ dataset +│ digits: SYNTHETIC random data", out)
    assert read_json(tmp_path / "run" / "privacy_ledger.json")["dataset"]["synthetic"] is True
