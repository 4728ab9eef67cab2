"""A shuffled run (each epoch of steps charged once) resumes only where its epochs stay aligned:
steps an earlier process committed and a resumed one would not replay exactly are refused."""

from __future__ import annotations

from pathlib import Path

from test_trainer_support import resume_after_a_crash_is_refused


def test_a_resume_that_would_charge_steps_outside_their_shuffled_epoch_is_refused(
        tmp_path: Path) -> None:
    resume_after_a_crash_is_refused(tmp_path, {"sampling": "shuffle"}, "shuffled epoch")
