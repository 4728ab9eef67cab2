"""Resume: a run interrupted and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_support import Killed, final_weights, make_job, make_settings, rewrite_history

from dptrain.train.loop import train

STEPS_PER_EPOCH = 4  # 48 samples, batches of 12


def _interrupted_then_resumed(tmp_path: Path, private: bool, **job_kwargs) -> tuple:
    job = make_job(private=private, dropout=0.3, **job_kwargs)
    train(job, make_settings(tmp_path, epochs=3, max_steps=STEPS_PER_EPOCH))
    job = make_job(private=private, dropout=0.3, **job_kwargs)   # a new process rebuilds the job
    result = train(job, make_settings(tmp_path, epochs=3, resume="auto"))
    return job, result


def _metric_lines(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl and private_metrics.jsonl (training loss...) but the time."""
    lines = [json.loads(x) for name in ("metrics.jsonl", "private_metrics.jsonl")
             for x in (run_dir / name).read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "time"} for line in lines]


def test_non_private_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    straight = make_job(private=False, dropout=0.3)
    train(straight, make_settings(tmp_path / "a", epochs=3))
    resumed, result = _interrupted_then_resumed(tmp_path / "b", private=False)
    assert result.steps == 3 * STEPS_PER_EPOCH
    for name, value in final_weights(straight).items():
        assert torch.equal(value, final_weights(resumed)[name]), name


def test_resumed_metrics_equal_uninterrupted_metrics(tmp_path: Path) -> None:
    train(make_job(private=False, dropout=0.3), make_settings(tmp_path / "a", epochs=3))
    _interrupted_then_resumed(tmp_path / "b", private=False)
    assert _metric_lines(tmp_path / "a") == _metric_lines(tmp_path / "b")


def test_private_resume_equals_uninterrupted_run_with_seeded_noise(tmp_path: Path) -> None:
    from dptrain.train.ledger import load_ledger

    straight = make_job(private=True, dropout=0.3)
    expected = train(straight, make_settings(tmp_path / "a", epochs=3))
    resumed, result = _interrupted_then_resumed(tmp_path / "b", private=True)
    for name, value in final_weights(straight).items():
        assert torch.equal(value, final_weights(resumed)[name]), name
    assert load_ledger(tmp_path / "a")["history"] == load_ledger(tmp_path / "b")["history"]
    assert result.epsilon == expected.epsilon


def test_resume_after_a_crash_mid_epoch_equals_uninterrupted_run(tmp_path: Path) -> None:
    from dptrain.train.ledger import load_ledger

    calls = {"n": 0}

    def crashing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == STEPS_PER_EPOCH + 2:
            raise Killed   # killed in the middle of epoch 2
        return torch.nn.functional.cross_entropy(out, y)

    straight = make_job(private=True)
    train(straight, make_settings(tmp_path / "a", epochs=3))
    with pytest.raises(Killed):
        train(make_job(private=True, loss_fn=crashing_loss), make_settings(tmp_path / "b", epochs=3))
    assert load_ledger(tmp_path / "b")["status"] == "failed"
    resumed = make_job(private=True)
    train(resumed, make_settings(tmp_path / "b", epochs=3, resume="auto"))
    for name, value in final_weights(straight).items():
        assert torch.equal(value, final_weights(resumed)[name]), name
    ledger = load_ledger(tmp_path / "b")
    assert ledger["history"] == load_ledger(tmp_path / "a")["history"]
    assert ledger["resumes"][-1]["discarded_committed_steps"] == STEPS_PER_EPOCH


@pytest.mark.parametrize("private", [True, False])
def test_resume_from_a_mid_epoch_stop_equals_uninterrupted_run(tmp_path: Path, private: bool) -> None:
    straight = make_job(private=private, dropout=0.3)
    train(straight, make_settings(tmp_path / "a", epochs=3))
    job = make_job(private=private, dropout=0.3)
    train(job, make_settings(tmp_path / "b", epochs=3, max_steps=STEPS_PER_EPOCH + 2))
    resumed = make_job(private=private, dropout=0.3)
    train(resumed, make_settings(tmp_path / "b", epochs=3, resume="auto"))
    for name, value in final_weights(straight).items():
        assert torch.equal(value, final_weights(resumed)[name]), name


def test_secure_mode_refuses_to_resume_behind_a_written_checkpoint(tmp_path: Path) -> None:
    from dptrain.errors import PrivacyError

    train(make_job(private=True, secure=True), make_settings(tmp_path, epochs=2))
    older = tmp_path / "checkpoints" / "epoch_1.pt"
    with pytest.raises(PrivacyError, match="secure_mode"):
        train(make_job(private=True, secure=True), make_settings(tmp_path, resume=str(older)))


def test_secure_mode_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    train(make_job(private=True, secure=True), make_settings(tmp_path, epochs=3, max_steps=8))
    result = train(make_job(private=True, secure=True), make_settings(tmp_path, epochs=3,
                                                                       resume="auto"))
    assert (result.status, result.steps) == ("completed", 12)


def test_resume_over_a_ledger_whose_records_show_more_steps_than_its_history_is_refused(
        tmp_path: Path) -> None:
    from dptrain.errors import ConfigError

    train(make_job(), make_settings(tmp_path, epochs=3))
    rewrite_history(tmp_path, steps=2 * STEPS_PER_EPOCH)    # 12 steps taken, 8 in the history
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"checkpoints/epoch_3.pt: step 12.*8 steps.*resumed"):
        train(make_job(), make_settings(tmp_path, epochs=4, resume=str(
            tmp_path / "checkpoints" / "epoch_1.pt")))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_resume_drops_a_metrics_line_torn_by_a_crash(tmp_path: Path) -> None:
    train(make_job(private=False, dropout=0.3), make_settings(tmp_path / "a", epochs=3))
    train(make_job(private=False, dropout=0.3),
          make_settings(tmp_path / "b", epochs=3, max_steps=STEPS_PER_EPOCH))
    with open(tmp_path / "b" / "metrics.jsonl", "a") as log:
        log.write('{"epoch": 2, "st')          # a line cut by SIGKILL
    train(make_job(private=False, dropout=0.3), make_settings(tmp_path / "b", epochs=3, resume="auto"))
    assert _metric_lines(tmp_path / "a") == _metric_lines(tmp_path / "b")
