"""`dptrain tune`: a sweep with a random number of trials (dptrain.cli.tune) and the
random-stopping bound its sweep ledger states."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli_sweep_summary import done, make_job
from test_sweep_ledger import _ledger

import dptrain.cli.tune
from dptrain.accounting.history import history_from_json
from dptrain.accounting.tuning import (
    composed_epsilon,
    repeat_and_select_epsilon,
    truncated_negative_binomial_trials,
)
from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.cli.sweep_ledger import SWEEP_LEDGER_FILENAME, TUNING_FILENAME, sweep_cost
from dptrain.cli.tune import draw_trials, expand_grid
from dptrain_runner import QUIET, read_json, run_in_process

SEED_OF_ONE_TRIAL = 2   # np.random.default_rng(2): K = 1 under --tnb 1 0.5


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Path:
    """A real `dptrain tune --tnb 1 0.5` over two learning rates (one trial drawn)."""
    folder = tmp_path_factory.mktemp("tune")
    mp = pytest.MonkeyPatch()
    mp.setattr(dptrain.cli.tune, "secret_rng", lambda: np.random.default_rng(SEED_OF_ONE_TRIAL))
    try:
        code, _, err = run_in_process(
            ["tune", "--tnb", "1", "0.5", "optimizer.lr=0.1,0.5", "privacy=sigma",
             "privacy.noise_multiplier=1", "train.epochs=1", "train.batch_size=256",
             "hydra.sweep.dir=tune", *QUIET], folder, mp, _NoCapture())
    finally:
        mp.undo()
    assert code == 0, err
    return folder / "tune"


class _NoCapture:
    def readouterr(self) -> tuple[str, str]:
        return "", ""


def test_the_grid_is_the_product_of_the_swept_overrides_and_hydra_keys_stay_fixed():
    fixed, grid = expand_grid(["a=1,2", "privacy=sigma", "b=range(0,2)", "hydra.sweep.dir=x"])
    assert fixed == ["privacy=sigma", "hydra.sweep.dir=x"]
    assert grid == [["a=1", "b=0"], ["a=1", "b=1"], ["a=2", "b=0"], ["a=2", "b=1"]]


def test_the_number_of_trials_is_drawn_and_each_trial_is_a_grid_point():
    trials = truncated_negative_binomial_trials(1.0, 0.2)
    grid = [["a=1"], ["a=2"], ["a=3"]]
    drawn = draw_trials(trials, grid, np.random.default_rng(7))
    assert len(drawn) == trials.draw(np.random.default_rng(7)) >= 1
    assert all(point in grid for point in drawn)


def test_a_tuning_sweep_records_its_draw_before_training_and_runs_exactly_the_drawn_trials(tuned):
    tuning = read_json(tuned / TUNING_FILENAME)
    assert tuning["trials"] == {"distribution": "truncated_negative_binomial", "eta": 1.0,
                                "gamma": 0.5, "mean_trials": 2.0}
    assert [job["job"] for job in tuning["jobs"]] == ["0"] and not (tuned / "1").exists()
    assert tuning["jobs"][0]["overrides"][0] in ("optimizer.lr=0.1", "optimizer.lr=0.5")


def test_a_tuning_sweep_states_the_random_stopping_bound_of_its_trials(tuned):
    ledger = read_json(tuned / SWEEP_LEDGER_FILENAME)
    history = history_from_json(read_json(tuned / "0" / "privacy_ledger.json")["history"])
    bound = repeat_and_select_epsilon([history], truncated_negative_binomial_trials(1.0, 0.5), 1e-5)
    stopping = ledger["cost"]["random_stopping"]
    assert stopping["epsilon"] == pytest.approx(bound, rel=1e-9) and stopping["accountant"] == "rdp"
    composed = ledger["cost"]["all_composed"]["epsilon"]
    assert ledger["epsilon"] == min(composed, bound) and ledger["selection"]["trials_drawn"] == 1
    assert read_json(tuned / "sweep_summary.json")["cost_of_best"]["cost"]["random_stopping"] == stopping


def test_dptrain_ledger_verifies_a_tuning_sweep(tuned):
    assert ledger_main([str(tuned)]) == 0


def test_tune_refuses_a_sweep_folder_that_already_holds_a_sweep(tuned, monkeypatch, capsys):
    code, _, err = run_in_process(["tune", "--poisson", "3", "optimizer.lr=0.1,0.5",
                                   f"hydra.sweep.dir={tuned}"], tuned.parent, monkeypatch, capsys)
    assert code == 2 and "already holds a sweep" in err


def test_tune_refuses_an_invalid_distribution_in_one_line(tmp_path, monkeypatch, capsys):
    code, _, err = run_in_process(["tune", "--tnb", "1", "1.5", "optimizer.lr=0.1,0.5"],
                                  tmp_path, monkeypatch, capsys)
    assert code == 2 and "gamma=1.5" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "multirun").exists()


def test_the_random_stopping_bound_holds_only_once_every_drawn_trial_has_run(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=1"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    (tmp_path / TUNING_FILENAME).write_text(json.dumps({
        "trials": {"distribution": "poisson", "mean_trials": 2.0},
        "jobs": [{"job": "0", "overrides": ["a=1"]}, {"job": "1", "overrides": ["a=2"]}]}))
    cost = sweep_cost(tmp_path)
    stopping = cost["cost"]["random_stopping"]
    assert stopping["epsilon"] is None and "does not hold" in stopping["reason"]
    assert cost["epsilon"] == pytest.approx(composed_epsilon([[(1.0, 0.1, 10)]], 1e-5, "rdp"))
