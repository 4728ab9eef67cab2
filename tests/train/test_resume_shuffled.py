"""A shuffled run (each epoch of steps charged once) resumes only where its epochs stay aligned:
steps an earlier process committed and a resumed one would not replay exactly are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_support import Killed, crash_at_call, make_job, make_settings

from dptrain.errors import ConfigError
from dptrain.train.loop import train

SHUFFLE = {"sampling": "shuffle"}


def test_a_resume_that_would_charge_steps_outside_their_shuffled_epoch_is_refused(
        tmp_path: Path) -> None:
    job = make_job(engine_kwargs=SHUFFLE, reproducible_mechanism=False, loss_fn=crash_at_call(6))
    with pytest.raises(Killed):
        train(job, make_settings(tmp_path, epochs=3))
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(ConfigError, match="shuffled epoch"):
        train(make_job(engine_kwargs=SHUFFLE, reproducible_mechanism=False),
              make_settings(tmp_path, epochs=3, resume="auto"))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before
