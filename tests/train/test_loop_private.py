"""The training loop on a private job: ledger contents, commit-ahead, budget guard, chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_support import N_TRAIN, final_weights, make_job, make_settings

from dptrain.train.ledger import (
    epsilon_of,
    history_from_json,
    history_steps,
    load_ledger,
    merge_history,
    schema_errors,
)
from dptrain.train.loop import train
from dptrain.errors import BudgetExhaustedError

Q = 12 / N_TRAIN


def test_private_run_claims_the_epsilon_of_its_history(tmp_path: Path) -> None:
    result = train(make_job(), make_settings(tmp_path))
    ledger = load_ledger(tmp_path)
    history = history_from_json(ledger["history"])
    assert result.epsilon == ledger["epsilon"] == epsilon_of(history, 1e-5, "rdp") > 0


def test_clean_finish_history_equals_the_steps_taken(tmp_path: Path) -> None:
    job = make_job()
    result = train(job, make_settings(tmp_path))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 12)] == merge_history(job.engine.accountant.history)
    assert (ledger["steps_completed"], ledger["committed_ahead"], result.steps) == (12, 0, 12)


def test_ledger_records_every_accountant_and_labels_gdp_approximate(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=1))
    claims = load_ledger(tmp_path)["epsilon_by_accountant"]
    assert {"rdp", "prv", "gdp"} <= set(claims)
    assert claims["gdp"]["approximate"] and not claims["rdp"]["approximate"]
    assert claims["rdp"]["epsilon"] == load_ledger(tmp_path)["epsilon"]


def test_ledger_describes_the_mechanism(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=1))
    mechanism = load_ledger(tmp_path)["mechanism"]
    assert mechanism["algorithm"] == "DP-SGD" and mechanism["sampling"] == "poisson"
    assert (mechanism["max_grad_norm"], mechanism["noise_multiplier"]) == (1.0, 1.0)


def test_ledger_records_layer_strategies_when_the_model_reports_them(tmp_path: Path) -> None:
    job = make_job()
    job.model.layer_strategies = lambda: {"0": "ghost", "3": "per_sample"}
    train(job, make_settings(tmp_path, epochs=1))
    assert load_ledger(tmp_path)["mechanism"]["layer_strategies"] == {"0": "ghost", "3": "per_sample"}


def test_steps_are_committed_to_disk_before_their_data_is_read(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []   # (steps on disk, steps completed) at each batch read
    ledger_path = tmp_path / "privacy_ledger.json"

    def auditing_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        data = json.loads(ledger_path.read_text())
        seen.append((history_steps(history_from_json(data["history"])), data["steps_completed"]))
        return torch.nn.functional.cross_entropy(out, y)

    train(make_job(loss_fn=auditing_loss), make_settings(tmp_path))
    assert len(seen) >= 1 and all(on_disk > completed for on_disk, completed in seen)


def test_metrics_epsilon_grows_each_epoch(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eps = [line["epsilon"] for line in lines]
    assert eps == sorted(eps) and eps[0] > 0 and len(set(eps)) == 3


def test_physical_chunks_give_the_same_weights_as_whole_batches(tmp_path: Path) -> None:
    whole, chunked = make_job(), make_job()
    train(whole, make_settings(tmp_path / "a", epochs=2))
    result = train(chunked, make_settings(tmp_path / "b", epochs=2, max_physical_batch_size=4))
    assert result.steps == 8
    for name, value in final_weights(whole).items():
        torch.testing.assert_close(final_weights(chunked)[name], value, rtol=1e-9, atol=1e-12)


def _target_for(steps: int) -> float:
    """A target between the epsilons of `steps` and `steps + 1` steps."""
    low = epsilon_of([(1.0, Q, steps)], 1e-5, "rdp")
    high = epsilon_of([(1.0, Q, steps + 1)], 1e-5, "rdp")
    return (low + high) / 2


def test_budget_guard_stops_before_the_step_that_would_exceed_the_target(tmp_path: Path) -> None:
    target = _target_for(7)
    result = train(make_job(target_epsilon=target), make_settings(tmp_path))
    ledger = load_ledger(tmp_path)
    assert (result.status, result.steps, ledger["status"]) == ("stopped_at_budget", 7, "stopped_at_budget")
    assert ledger["epsilon"] <= target < epsilon_of([(1.0, Q, 8)], 1e-5, "rdp")


def test_a_run_cannot_be_resumed_past_its_budget(tmp_path: Path) -> None:
    target = _target_for(7)
    train(make_job(target_epsilon=target), make_settings(tmp_path))
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    with pytest.raises(BudgetExhaustedError, match="target_epsilon"):
        train(make_job(target_epsilon=target), make_settings(tmp_path, resume="auto"))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


def test_empty_poisson_batches_are_still_steps_in_the_ledger(tmp_path: Path) -> None:
    job = make_job(batch_size=1)             # q = 1/48: many batches are empty
    result = train(job, make_settings(tmp_path, epochs=1))
    assert result.steps == len(job.train_loader) == 48
    assert history_from_json(load_ledger(tmp_path)["history"]) == [(1.0, 1 / N_TRAIN, 48)]


def test_each_checkpoint_entry_carries_the_epsilon_at_its_step(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, checkpoint_every=1))
    entries = load_ledger(tmp_path)["checkpoints"]   # the files on disk: last.pt at step 12
    assert [e["step"] for e in entries] == [4, 8, 12, 12]
    for entry in entries:
        assert entry["epsilon"] == epsilon_of([(1.0, Q, entry["step"])], 1e-5, "rdp")


def test_ghost_clipping_layer_choices_seen_in_training_reach_the_ledger(tmp_path: Path) -> None:
    train(make_job(engine_kwargs={"grad_sample_mode": "ghost"}), make_settings(tmp_path, epochs=1))
    strategies = load_ledger(tmp_path)["mechanism"]["layer_strategies"]
    assert set(strategies) == {"0", "3"} and set(strategies.values()) <= {"ghost", "instantiate"}


def test_private_ledger_validates_against_its_schema(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=1))
    data = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert schema_errors(data) == []
