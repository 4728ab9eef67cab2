"""What a run writes about its noise and sampling: their seeding in the ledger and summary,
generator states only in resume checkpoints (and only for a reproducible mechanism), a
weights-only model file to release, and resumes that keep steps charged when the noise cannot be
replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer_support import N_TRAIN, crash, final_weights, make_job, make_settings

from dptrain.data.sampling import PoissonBatchSampler
from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.job import unwrap
from dptrain.train.ledger import history_from_json, history_steps, load_ledger
from dptrain.train.loop import train
from dptrain.train.replay import start_fingerprint

Q = 12 / N_TRAIN
STEPS_PER_EPOCH = 4


def test_by_default_the_ledger_says_noise_and_sampling_are_seeded_from_os_entropy(
        tmp_path: Path) -> None:
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=1))
    mechanism = load_ledger(tmp_path)["mechanism"]
    assert mechanism["randomness"] == "os_entropy" and "randomness_note" not in mechanism


def test_a_reproducible_mechanism_is_flagged_in_the_ledger_and_the_run_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one summary row per line
    train(make_job(reproducible_mechanism=True), make_settings(tmp_path, epochs=1))
    mechanism = load_ledger(tmp_path)["mechanism"]
    assert mechanism["randomness"] == "reproducible"
    assert "NOT a guarantee if the seed is known" in mechanism["randomness_note"]
    assert "which examples were in each batch" in mechanism["randomness_note"]
    assert "noise and sampling REPRODUCIBLE" in capsys.readouterr().out


def test_the_released_model_file_holds_the_weights_and_nothing_else(tmp_path: Path) -> None:
    job = make_job(reproducible_mechanism=True, validation=True)
    train(job, make_settings(tmp_path, keep_best=True))
    released = torch.load(tmp_path / "model.pt", weights_only=True)
    assert released.keys() == final_weights(job).keys()
    assert all(torch.equal(released[k], v) for k, v in final_weights(job).items())
    best = torch.load(tmp_path / "model_best.pt", weights_only=True)
    best_checkpoint = load_checkpoint(tmp_path / "checkpoints" / "best.pt")["model"]
    assert best.keys() == best_checkpoint.keys()
    assert all(torch.equal(best[k], v) for k, v in best_checkpoint.items())


def test_checkpoints_hold_no_state_of_generators_seeded_from_os_entropy(tmp_path: Path) -> None:
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=1))
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert state["generators"] == {}   # neither the noise's nor the Poisson sampler's
    assert state["engine"]["engine"]["noise_generator"] is None
    assert "generator" not in state["engine"]["engine"]["sampler"]


def test_a_crash_with_unpredictable_noise_keeps_the_steps_after_the_checkpoint_charged(
        tmp_path: Path) -> None:
    crashed = crash(tmp_path, STEPS_PER_EPOCH + 2, reproducible_mechanism=False)  # after epoch_1.pt
    lost = history_steps(history_from_json(crashed["history"])) - STEPS_PER_EPOCH
    assert lost > 0
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 3 * STEPS_PER_EPOCH + lost)]
    assert ledger["resumes"][-1]["charged_steps"] == lost


def test_a_restart_with_unpredictable_noise_from_the_same_start_keeps_the_crashed_steps_charged(
        tmp_path: Path) -> None:
    crashed = crash(tmp_path, 3, reproducible_mechanism=False)   # in epoch 1: no checkpoint yet
    committed = history_steps(history_from_json(crashed["history"]))
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert ledger["resumes"][-1]["charged_steps"] == committed
    assert history_from_json(ledger["history"]) == [(1.0, Q, committed + 3 * STEPS_PER_EPOCH)]


def test_a_rewind_with_unpredictable_noise_charges_the_replayed_steps_in_addition(
        tmp_path: Path) -> None:
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=2))
    older = tmp_path / "checkpoints" / "epoch_1.pt"
    train(make_job(reproducible_mechanism=False),
          make_settings(tmp_path, epochs=2, resume=str(older)))
    ledger = load_ledger(tmp_path)   # 8 steps released, then steps 5-8 again with fresh noise
    assert history_from_json(ledger["history"]) == [(1.0, Q, 3 * STEPS_PER_EPOCH)]
    assert ledger["resumes"][-1]["charged_steps"] == STEPS_PER_EPOCH


def test_a_resume_with_unpredictable_sampling_draws_fresh_batches_for_the_replayed_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Charging a replayed step in addition is right for a fresh Poisson batch; the same batch
    # released again with new noise would cost more than an independent step.
    drawn: list[list[int]] = []
    original = PoissonBatchSampler.draw
    monkeypatch.setattr(PoissonBatchSampler, "draw",
                        lambda self: drawn.append(original(self)) or drawn[-1])
    crash(tmp_path, STEPS_PER_EPOCH + 2, reproducible_mechanism=False)  # after epoch_1.pt
    crashed = drawn[STEPS_PER_EPOCH:STEPS_PER_EPOCH + 2]                # steps 5 and 6
    drawn.clear()
    train(make_job(reproducible_mechanism=False), make_settings(tmp_path, epochs=3, resume="auto"))
    assert len(crashed) == 2 and all(a != b for a, b in zip(crashed, drawn[:2]))


def test_the_ledgers_start_fingerprint_covers_no_generator_seeded_from_os_entropy(
        tmp_path: Path) -> None:
    job = make_job(reproducible_mechanism=False)
    weights_alone = start_fingerprint(unwrap(job.model), {})
    train(job, make_settings(tmp_path, epochs=1))
    assert load_ledger(tmp_path)["start_fingerprint"] == weights_alone
