"""Steps an earlier process committed beyond the resume point: never dropped from the ledger.

An exact replay (reproducible noise, a checkpoint or a restart from the same starting state, on
the CPU) recomputes the same batches and noise, so each of those steps is charged once: the ledger
ends equal to an uninterrupted run's when the resumed run retakes them all, and keeps those it
does not retake. Any other replay (noise seeded from OS entropy, secure mode, a restart from
another starting state, a device other than the CPU) charges them in addition, so the ledger
never counts less than what an earlier process may have released.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_trainer_support import (N_TRAIN, Killed, changed_record, crash, crash_at_call, make_job,
                                  make_settings, tiny_config, tiny_data)

from dptrain.train.checkpoint import load_checkpoint
from dptrain.train.ledger import epsilon_of, history_from_json, history_steps, load_ledger
from dptrain.train import replay
from dptrain.data.fingerprint import UNKNOWN, data_fingerprint
from dptrain.train.replay import (data_difference, replay_is_exact, steps_after, still_charged,
                                  with_replayed)
from dptrain.train.loop import train
from dptrain.errors import ConfigError

Q = 12 / N_TRAIN
STEPS_PER_EPOCH = 4


def _metric_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_steps_after_keeps_the_tail_of_a_history() -> None:
    history = [(1.0, 0.1, 3), (0.5, 0.1, 4)]
    assert steps_after(history, 5) == [(0.5, 0.1, 2)]
    assert steps_after(history, 0) == history and steps_after(history, 7) == []


def test_an_exact_replay_charges_nothing_else_the_whole_tail() -> None:
    history = [(1.0, 0.1, 10)]
    assert still_charged(history, 4, replays_exactly=True) == []
    assert still_charged(history, 4, replays_exactly=False) == [(1.0, 0.1, 6)]


def test_a_replay_is_exact_only_with_a_reproducible_mechanism() -> None:
    assert replay_is_exact(["cpu"], True, from_checkpoint=True, same_start=True, same_data=True)
    assert not replay_is_exact(["cpu"], False, from_checkpoint=True, same_start=True,
                               same_data=True)


def test_a_restart_before_any_checkpoint_from_the_same_start_equals_an_uninterrupted_run(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path / "a", epochs=3))
    crashed = crash(tmp_path / "b", at_call=3)              # in epoch 1: no checkpoint yet
    assert crashed["checkpoints"] == [] and history_steps(history_from_json(crashed["history"])) > 0
    train(make_job(), make_settings(tmp_path / "b", epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path / "b")
    assert ledger["history"] == load_ledger(tmp_path / "a")["history"]
    resume = ledger["resumes"][-1]
    assert (resume["checkpoint"], resume["charged_steps"]) == (None, 0)


def test_a_restart_from_another_starting_state_keeps_the_crashed_steps_charged(
        tmp_path: Path) -> None:
    crashed = crash(tmp_path, at_call=3)
    committed = history_steps(history_from_json(crashed["history"]))
    train(make_job(seed=7), make_settings(tmp_path, epochs=3, resume="auto"))  # other init/noise
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, committed + 3 * STEPS_PER_EPOCH)]
    assert ledger["resumes"][-1]["charged_steps"] == committed
    assert ledger["steps_completed"] == committed + 3 * STEPS_PER_EPOCH


def test_secure_mode_keeps_the_steps_committed_after_the_last_checkpoint_charged(
        tmp_path: Path) -> None:
    crashed = crash(tmp_path, at_call=STEPS_PER_EPOCH + 2, secure=True)   # in epoch 2
    lost = history_steps(history_from_json(crashed["history"])) - STEPS_PER_EPOCH
    assert lost > 0
    result = train(make_job(secure=True), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    total = 3 * STEPS_PER_EPOCH + lost
    assert history_from_json(ledger["history"]) == [(1.0, Q, total)]
    assert result.epsilon == ledger["epsilon"] == epsilon_of([(1.0, Q, total)], 1e-5, "rdp")
    assert ledger["resumes"][-1]["charged_steps"] == lost


def test_charged_steps_survive_a_second_resume_through_the_checkpoint(tmp_path: Path) -> None:
    crashed = crash(tmp_path, at_call=STEPS_PER_EPOCH + 2, secure=True)
    lost = history_steps(history_from_json(crashed["history"])) - STEPS_PER_EPOCH
    train(make_job(secure=True), make_settings(tmp_path, epochs=3, max_steps=10, resume="auto"))
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["charged"] == [(1.0, Q, lost)]
    train(make_job(secure=True), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 3 * STEPS_PER_EPOCH + lost)]


def test_each_checkpoint_entry_counts_the_charged_steps_in_its_epsilon(tmp_path: Path) -> None:
    crashed = crash(tmp_path, at_call=STEPS_PER_EPOCH + 2, secure=True)
    lost = history_steps(history_from_json(crashed["history"])) - STEPS_PER_EPOCH
    train(make_job(secure=True), make_settings(tmp_path, epochs=3, resume="auto"))
    last = load_ledger(tmp_path)["checkpoints"][-1]
    assert last["step"] == 3 * STEPS_PER_EPOCH
    assert last["epsilon"] == epsilon_of([(1.0, Q, last["step"] + lost)], 1e-5, "rdp")


def test_resume_auto_refuses_a_ledger_of_another_config_even_without_checkpoint(
        tmp_path: Path) -> None:
    crash(tmp_path, at_call=3)
    before = (tmp_path / "privacy_ledger.json").read_bytes()
    other = make_job(config=tiny_config(**{"optimizer.lr": 0.5}))
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        train(other, make_settings(tmp_path, epochs=3, resume="auto"))
    assert (tmp_path / "privacy_ledger.json").read_bytes() == before


def test_a_restart_from_step_0_drops_the_crashed_runs_metrics_lines(tmp_path: Path) -> None:
    with pytest.raises(Killed):
        train(make_job(loss_fn=crash_at_call(STEPS_PER_EPOCH + 2)),
              make_settings(tmp_path, epochs=3, checkpoint_every=0))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1   # epoch 1's line
    train(make_job(), make_settings(tmp_path / "a", epochs=3, checkpoint_every=0))
    train(make_job(), make_settings(tmp_path, epochs=3, checkpoint_every=0, resume="auto"))
    assert _metric_steps(tmp_path) == _metric_steps(tmp_path / "a")


def test_an_exact_replay_charges_each_retaken_step_once_and_keeps_the_others() -> None:
    replayed = [(1.0, 0.1, 20)]                      # steps 5..24 of an earlier process
    own = [(1.0, 0.1, 5)]                            # resumed at step 5
    assert with_replayed(own, 5, replayed) == [(1.0, 0.1, 25)]
    assert with_replayed([(1.0, 0.1, 8)], 5, replayed) == [(1.0, 0.1, 25)]
    assert with_replayed([(1.0, 0.1, 30)], 5, replayed) == [(1.0, 0.1, 30)]
    assert with_replayed([(1.0, 0.1, 5), (0.5, 0.1, 2)], 5, replayed) == \
        [(1.0, 0.1, 5), (0.5, 0.1, 2), (1.0, 0.1, 18)]


def test_resuming_from_an_older_checkpoint_to_the_end_charges_each_step_once(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    finished = load_ledger(tmp_path)
    train(make_job(), make_settings(tmp_path, epochs=3,
                                    resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    assert ledger["history"] == finished["history"] and ledger["epsilon"] == finished["epsilon"]
    assert ledger["resumes"][-1]["discarded_committed_steps"] == 2 * STEPS_PER_EPOCH


def test_a_crash_just_after_resuming_from_an_older_checkpoint_keeps_every_step_charged(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    with pytest.raises(Killed):
        train(make_job(loss_fn=crash_at_call(1)),
              make_settings(tmp_path, epochs=3, max_steps=STEPS_PER_EPOCH + 1,
                            resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    assert ledger["status"] == "failed"
    assert history_from_json(ledger["history"]) == [(1.0, Q, 3 * STEPS_PER_EPOCH)]


def test_an_exact_rewind_of_a_run_stopped_at_its_budget_retakes_its_steps_and_stops_there(
        tmp_path: Path) -> None:
    target = (epsilon_of([(1.0, Q, 6)], 1e-5, "rdp") + epsilon_of([(1.0, Q, 7)], 1e-5, "rdp")) / 2
    first = train(make_job(target_epsilon=target), make_settings(tmp_path, epochs=3))
    assert (first.status, first.steps) == ("stopped_at_budget", 6)
    again = train(make_job(target_epsilon=target), make_settings(
        tmp_path, epochs=3, resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    assert (again.status, again.steps, again.epsilon) == ("stopped_at_budget", 6, first.epsilon)


def test_only_steps_computed_and_replayed_on_the_cpu_are_trusted_to_replay_bit_for_bit() -> None:
    assert replay_is_exact(["cpu"], True, from_checkpoint=True, same_start=False, same_data=True)
    for devices in (["cuda"], ["cpu", "cuda"], ["mps"], ["cpu", "unknown"]):
        assert not replay_is_exact(devices, True, from_checkpoint=True, same_start=True,
                                   same_data=True), devices


def test_a_resume_off_the_cpu_keeps_every_computed_step_charged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay, "bitwise_reproducible", lambda device: False)  # as on CUDA
    train(make_job(), make_settings(tmp_path, epochs=3))
    train(make_job(), make_settings(tmp_path, epochs=3,
                                    resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 5 * STEPS_PER_EPOCH)]
    assert ledger["resumes"][-1]["charged_steps"] == 2 * STEPS_PER_EPOCH


def test_a_cpu_resume_of_steps_a_gpu_computed_keeps_them_charged(tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    ledger_file = tmp_path / "privacy_ledger.json"
    ledger = json.loads(ledger_file.read_text())
    assert ledger["devices"] == ["cpu"]
    ledger_file.write_text(json.dumps({**ledger, "devices": ["cuda"]}))   # as if run on a GPU
    train(make_job(), make_settings(tmp_path, epochs=3,
                                    resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 5 * STEPS_PER_EPOCH)]
    assert ledger["devices"] == ["cpu", "cuda"]


def test_a_replay_is_exact_only_over_the_same_training_data() -> None:
    assert not replay_is_exact(["cpu"], True, from_checkpoint=True, same_start=True,
                               same_data=False)


def test_the_data_are_the_same_only_when_every_recorded_fingerprint_is_the_known_current_one(
        ) -> None:
    a, b = "a" * 64, "b" * 64
    assert data_difference([a], a) is None and data_difference([a, a], a) is None
    assert "differ" in data_difference([a], b) and "differ" in data_difference([b, a], a)
    assert "unknown" in data_difference([UNKNOWN], a)
    assert "unknown" in data_difference([a], UNKNOWN)
    assert data_difference([UNKNOWN], UNKNOWN) is not None


def test_a_resume_over_a_changed_record_charges_the_replayed_steps_again(tmp_path: Path) -> None:
    first = train(make_job(), make_settings(tmp_path, epochs=3))
    again = train(make_job(train_set=changed_record()), make_settings(
        tmp_path, epochs=3, resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    every_step = [(1.0, Q, 5 * STEPS_PER_EPOCH)]   # 3 epochs, then epochs 2 and 3 again
    assert history_from_json(ledger["history"]) == every_step
    assert again.epsilon == ledger["epsilon"] == epsilon_of(every_step, 1e-5, "rdp")
    assert again.epsilon > first.epsilon
    assert ledger["resumes"][-1]["charged_steps"] == 2 * STEPS_PER_EPOCH
    assert ledger["dataset"]["fingerprints"] == [data_fingerprint(tiny_data()[0]),
                                                 data_fingerprint(changed_record())]


def test_a_restart_from_step_0_over_a_changed_record_keeps_the_crashed_steps_charged(
        tmp_path: Path) -> None:
    crashed = crash(tmp_path, at_call=3)                    # in epoch 1: no checkpoint yet
    committed = history_steps(history_from_json(crashed["history"]))
    train(make_job(train_set=changed_record()), make_settings(tmp_path, epochs=3, resume="auto"))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, committed + 3 * STEPS_PER_EPOCH)]
    assert ledger["resumes"][-1]["charged_steps"] == committed


def test_once_the_data_changed_every_later_replay_of_the_run_is_charged_again(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    older = str(tmp_path / "checkpoints" / "epoch_1.pt")
    train(make_job(train_set=changed_record()), make_settings(tmp_path, epochs=3, resume=older))
    train(make_job(), make_settings(tmp_path, epochs=3, resume=older))   # the original data
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 7 * STEPS_PER_EPOCH)]


def test_a_ledger_written_before_data_fingerprints_replays_as_a_new_computation(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path, epochs=3))
    ledger_file = tmp_path / "privacy_ledger.json"
    ledger = json.loads(ledger_file.read_text())
    del ledger["dataset"]["fingerprints"]                  # as an older dptrain wrote it
    ledger_file.write_text(json.dumps(ledger))
    train(make_job(), make_settings(tmp_path, epochs=3,
                                    resume=str(tmp_path / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path)
    assert history_from_json(ledger["history"]) == [(1.0, Q, 5 * STEPS_PER_EPOCH)]
    assert ledger["dataset"]["fingerprints"] == [UNKNOWN, data_fingerprint(tiny_data()[0])]


def test_a_resume_from_a_checkpoint_of_other_data_is_charged_as_a_new_computation(
        tmp_path: Path) -> None:
    train(make_job(), make_settings(tmp_path / "other", epochs=3))   # same config, other data
    train(make_job(train_set=changed_record()), make_settings(tmp_path / "run", epochs=3))
    train(make_job(train_set=changed_record()), make_settings(
        tmp_path / "run", epochs=3, resume=str(tmp_path / "other" / "checkpoints" / "epoch_1.pt")))
    ledger = load_ledger(tmp_path / "run")
    assert history_from_json(ledger["history"]) == [(1.0, Q, 5 * STEPS_PER_EPOCH)]


def test_a_resume_from_an_older_checkpoint_reports_the_steps_charged_beyond_those_trained(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = dict(reproducible_mechanism=False)     # new noise: the replayed steps are new releases
    train(make_job(**fresh), make_settings(tmp_path, epochs=3, keep_checkpoints=None))
    capsys.readouterr()
    older = str(tmp_path / "checkpoints" / "epoch_1.pt")
    result = train(make_job(**fresh), make_settings(tmp_path, epochs=3, keep_checkpoints=None,
                                                    resume=older))
    charged = history_steps(history_from_json(load_ledger(tmp_path)["history"]))
    assert result.steps == 3 * STEPS_PER_EPOCH
    assert result.steps_charged == charged == 5 * STEPS_PER_EPOCH   # epochs 2 and 3 twice
    summary = " ".join(capsys.readouterr().out.split())
    assert (f"steps charged │ {charged}: {2 * STEPS_PER_EPOCH} more than the model trained"
            in summary)
