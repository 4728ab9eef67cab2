"""The sweep ledger's epsilon holds as stated: one privacy unit per total, and a random-stopping
bound whose per-trial curve covers every grid point `dptrain tune` could have drawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_sweep_summary import done, make_job

from dptrain.accounting.history import history_to_json
from dptrain.accounting.tuning import (
    composed_epsilon,
    poisson_trials,
    repeat_and_select_epsilon,
    truncated_negative_binomial_trials,
)
from dptrain.cli.sweep_ledger import (
    SWEEP_LEDGER_FILENAME,
    TUNING_FILENAME,
    sweep_cost,
    verify_sweep_ledger,
    write_sweep_ledger,
)
from dptrain.privacy.user_level import USER_PRIVACY_UNIT
from dptrain.train.ledger import PrivacyLedger

DELTA = 1e-5


def _ledger(job_dir: Path, history: list, unit: str = "example") -> None:
    """A finished private ledger in `job_dir` (rdp, Poisson, delta 1e-5) protecting `unit`."""
    mechanism = {"algorithm": "DP-SGD", "sampling": "poisson"}
    if unit == "user":
        mechanism.update(privacy_unit=USER_PRIVACY_UNIT, num_users=100, max_examples_per_user=4)
    ledger = PrivacyLedger.create(job_dir, config={}, dataset_name="digits", dataset_size=1000,
                                  mechanism=mechanism, accountant="rdp", target_epsilon=None,
                                  delta=DELTA)
    ledger.finish("completed", history, sum(n for _, _, n in history))


# ------------------------------------------------------------------ mixed privacy units
def test_a_sweep_mixing_user_and_example_level_jobs_states_no_single_total(tmp_path):
    _ledger(make_job(tmp_path, "0", ["privacy.unit=user"], done(1.0, 0.5)),
            [(1.0, 0.1, 10)], unit="user")
    _ledger(make_job(tmp_path, "1", ["privacy.unit=example"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    cost = sweep_cost(tmp_path)
    composed = cost["cost"]["all_composed"]
    assert cost["epsilon"] is None and composed["epsilon"] is None
    assert "privacy.unit=user" in composed["reason"] and "group privacy" in composed["reason"]
    assert cost["privacy_unit"] == "mixed"
    assert [job["unit"] for job in cost["jobs"]] == ["user", "example"]


def test_a_sweep_of_user_level_jobs_is_composed_under_the_user_unit(tmp_path):
    for job in ("0", "1"):
        _ledger(make_job(tmp_path, job, [f"a={job}"], done(1.0, 0.5)), [(1.0, 0.1, 10)],
                unit="user")
    cost = sweep_cost(tmp_path)
    assert cost["privacy_unit"] == "user"
    assert cost["epsilon"] == pytest.approx(
        composed_epsilon([[(1.0, 0.1, 10)]] * 2, DELTA, "rdp"))


def test_a_mixed_unit_random_stopping_bound_is_not_stated_either(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)], unit="user")
    _ledger(make_job(tmp_path, "1", ["a=1"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    _tuning(tmp_path, [["a=0"], ["a=1"]], [[(1.0, 0.1, 10)], [(1.0, 0.1, 10)]], drawn=[0, 1])
    stopping = sweep_cost(tmp_path)["cost"]["random_stopping"]
    assert stopping["epsilon"] is None and "privacy.unit=user" in stopping["reason"]


# ------------------------------------------------------------------ random stopping over a grid
CHEAP, COSTLY = [(2.0, 0.05, 20)], [(0.8, 0.2, 200)]   # the grid's two points' planned histories


def _tuning(sweep_dir: Path, grid: list, histories: list | None, drawn: list[int]) -> None:
    """A tuning.json (K ~ Poisson(2)) that drew grid points `drawn`, as `dptrain tune` writes
    it; `histories`: each grid point's planned history (None: a tuning.json written before they
    were recorded)."""
    record = {"trials": {"distribution": "poisson", "mean_trials": 2.0}, "grid": grid,
              "jobs": [{"job": str(i), "overrides": grid[g]} for i, g in enumerate(drawn)]}
    if histories is not None:
        record["grid_costs"] = [{"overrides": point, "history": None if history is None
                                 else history_to_json(history)}
                                for point, history in zip(grid, histories)]
    (sweep_dir / TUNING_FILENAME).write_text(json.dumps(record))


def _three_cheap_trials(sweep_dir: Path) -> None:
    """Three trials of the cheap grid point ran; the costly point was not drawn."""
    for job in ("0", "1", "2"):
        _ledger(make_job(sweep_dir, job, ["optimizer.lr=0.1"], done(1.0, 0.5)), CHEAP)
    _tuning(sweep_dir, [["optimizer.lr=0.1"], ["optimizer.lr=0.2"]], [CHEAP, COSTLY],
            drawn=[0, 0, 0])


def test_random_stopping_bounds_every_grid_point_not_only_the_trials_that_ran(tmp_path):
    _three_cheap_trials(tmp_path)
    stopping = sweep_cost(tmp_path)["cost"]["random_stopping"]
    worst = repeat_and_select_epsilon([COSTLY], poisson_trials(2.0), DELTA)
    assert stopping["epsilon"] == pytest.approx(worst, rel=1e-9)
    assert stopping["epsilon"] > repeat_and_select_epsilon([CHEAP], poisson_trials(2.0), DELTA)
    assert "caveat" not in stopping


def test_the_headline_epsilon_is_no_less_than_a_bound_that_holds_for_the_whole_grid(tmp_path):
    """Before: the headline was the random-stopping bound of the cheap trials that ran (0.738),
    below both bounds that hold (the 3 trials composed, 0.959; random stopping over the grid,
    38.5)."""
    _three_cheap_trials(tmp_path)
    cost = sweep_cost(tmp_path)
    composed = composed_epsilon([CHEAP] * 3, DELTA, "rdp")
    worst = repeat_and_select_epsilon([COSTLY], poisson_trials(2.0), DELTA)
    assert cost["cost"]["all_composed"]["epsilon"] == pytest.approx(composed)
    assert cost["epsilon"] == pytest.approx(min(composed, worst))
    assert cost["epsilon"] > repeat_and_select_epsilon([CHEAP], poisson_trials(2.0), DELTA)


def test_dptrain_ledger_recomputes_the_whole_grid_bound_and_catches_the_old_claim(tmp_path):
    _three_cheap_trials(tmp_path)
    ledger = write_sweep_ledger(tmp_path)
    assert verify_sweep_ledger(tmp_path).ok
    ledger["cost"]["random_stopping"]["epsilon"] = repeat_and_select_epsilon(
        [CHEAP], poisson_trials(2.0), DELTA)      # the old rule: the trials that ran only
    ledger["epsilon"] = ledger["cost"]["random_stopping"]["epsilon"]
    (tmp_path / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    assert not verify_sweep_ledger(tmp_path).ok


def test_a_trial_that_spent_other_than_its_grid_points_planned_cost_voids_the_bound(tmp_path):
    _ledger(make_job(tmp_path, "0", ["optimizer.lr=0.1"], done(1.0, 0.5)), [(0.5, 0.2, 20)])
    _tuning(tmp_path, [["optimizer.lr=0.1"], ["optimizer.lr=0.2"]], [CHEAP, COSTLY], drawn=[0])
    stopping = sweep_cost(tmp_path)["cost"]["random_stopping"]
    assert stopping["epsilon"] is None and "planned" in stopping["reason"]


def test_a_trial_stopped_early_by_its_budget_still_matches_its_planned_cost(tmp_path):
    _ledger(make_job(tmp_path, "0", ["optimizer.lr=0.1"], done(1.0, 0.5)), [(2.0, 0.05, 7)])
    _tuning(tmp_path, [["optimizer.lr=0.1"], ["optimizer.lr=0.2"]], [CHEAP, COSTLY], drawn=[0])
    stopping = sweep_cost(tmp_path)["cost"]["random_stopping"]
    assert stopping["epsilon"] == pytest.approx(
        repeat_and_select_epsilon([COSTLY], poisson_trials(2.0), DELTA), rel=1e-9)


def test_a_grid_point_without_privacy_makes_the_random_stopping_bound_infinite(tmp_path):
    _ledger(make_job(tmp_path, "0", ["privacy=sigma"], done(1.0, 0.5)), CHEAP)
    _tuning(tmp_path, [["privacy=sigma"], ["privacy=none"]], [CHEAP, None], drawn=[0])
    cost = sweep_cost(tmp_path)
    assert cost["cost"]["random_stopping"]["epsilon"] == float("inf")
    assert cost["epsilon"] == pytest.approx(composed_epsilon([CHEAP], DELTA, "rdp"))


# ------------------------------------------------------------------ a real `dptrain tune`
@pytest.fixture(scope="module")
def tuned_over_sigma(tmp_path_factory) -> Path:
    """A real `dptrain tune --tnb 1 0.5` over two sigmas (one trial drawn, of either)."""
    import numpy as np
    from test_cli_tune import SEED_OF_ONE_TRIAL, _NoCapture

    import dptrain.cli.tune
    from dptrain_runner import QUIET, run_in_process

    folder = tmp_path_factory.mktemp("tune_sigma")
    mp = pytest.MonkeyPatch()
    mp.setattr(dptrain.cli.tune, "secret_rng", lambda: np.random.default_rng(SEED_OF_ONE_TRIAL))
    try:
        code, _, err = run_in_process(
            ["tune", "--tnb", "1", "0.5", "privacy.noise_multiplier=2,0.6", "train.epochs=1",
             "train.batch_size=256", "hydra.sweep.dir=tune", *QUIET], folder, mp, _NoCapture())
    finally:
        mp.undo()
    assert code == 0, err
    return folder / "tune"


def test_tune_records_every_grid_points_cost_before_training_as_the_trial_then_spends_it(
        tuned_over_sigma):
    tuning = json.loads((tuned_over_sigma / TUNING_FILENAME).read_text())
    costs = {" ".join(c["overrides"]): c for c in tuning["grid_costs"]}
    assert set(costs) == {"privacy.noise_multiplier=2", "privacy.noise_multiplier=0.6"}
    assert all(c["sampling"] == "poisson" for c in costs.values())
    (job,) = tuning["jobs"]
    ledger = json.loads((tuned_over_sigma / "0" / "privacy_ledger.json").read_text())
    assert ledger["history"] == costs[" ".join(job["overrides"])]["history"]


def test_a_real_tuning_sweep_bounds_each_trial_by_the_costlier_sigma_and_verifies(
        tuned_over_sigma):
    from dptrain.accounting.history import history_from_json
    from dptrain.cli.ledger_cmd import main as ledger_main

    tuning = json.loads((tuned_over_sigma / TUNING_FILENAME).read_text())
    costly = next(history_from_json(c["history"]) for c in tuning["grid_costs"]
                  if c["overrides"] == ["privacy.noise_multiplier=0.6"])
    ledger = json.loads((tuned_over_sigma / SWEEP_LEDGER_FILENAME).read_text())
    bound = repeat_and_select_epsilon([costly], truncated_negative_binomial_trials(1.0, 0.5),
                                      DELTA)
    assert ledger["cost"]["random_stopping"]["epsilon"] == pytest.approx(bound, rel=1e-9)
    assert ledger_main([str(tuned_over_sigma)]) == 0


def test_tune_refuses_a_grid_point_it_cannot_plan_before_anything_is_drawn(tmp_path,
                                                                            monkeypatch, capsys):
    from dptrain_runner import run_in_process

    code, _, err = run_in_process(["tune", "--poisson", "2", "privacy.target_epsilon=0.0001,3",
                                   "train.epochs=1", "hydra.sweep.dir=tune"], tmp_path,
                                  monkeypatch, capsys)
    assert code == 2 and "grid point privacy.target_epsilon=0.0001 cannot be planned" in err
    assert not (tmp_path / "tune").exists()
