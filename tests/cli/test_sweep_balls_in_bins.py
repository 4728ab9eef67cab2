"""A sweep whose jobs are balls-in-bins runs (random allocation) states what releasing its best
job costs: every job's mechanism composed, as RDP curves added in each direction of add/remove
(dptrain.cli.sweep_ledger, dptrain.accounting.tuning.composed_rdp_epsilon), alone or beside
Poisson jobs; a shuffled job still makes it unknown, and a version-1 sweep ledger (which stated
a balls-in-bins sweep unknown) still verifies.

The expected figures are recomputed here from first principles: the remove direction of one
epoch of random allocation into k steps by a sum over the integer partitions of the order (not
the package's polynomial powers), Poisson's by the binomial expansion, the tight RDP conversion
written out. The add direction is taken from dptrain.accounting.random_allocation.rdp_add
(checked against the `random-allocation` package in tests/accounting/test_random_allocation.py)
only to show it is the smaller one at these points."""

from __future__ import annotations

import json
import math
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from scipy import special
from test_cli_sweep_summary import done, make_job

from dptrain.accounting import random_allocation
from dptrain.accounting.history import history_from_json, history_to_json, steps_per_epoch
from dptrain.accounting.tuning import poisson_trials, rdp_repeat_and_select
from dptrain.accounting.rdp import rdp_to_epsilon
from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.cli.sweep_ledger import (
    SWEEP_LEDGER_FILENAME,
    TUNING_FILENAME,
    sweep_cost,
    verify_sweep_ledger,
)
from dptrain.train.ledger import PrivacyLedger
from dptrain_runner import QUIET, read_json, run_once_in_process

ORDERS = range(2, 33)        # enough here: the best order of every figure below is under 20
SWEEP = ["privacy=sigma", "train.batch_size=256", *QUIET]   # digits: 6 steps an epoch


def _sweep(tmp_path_factory, name: str, overrides: list[str]) -> Path:
    """The sweep folder of a real `dptrain -m` with `overrides` (beside SWEEP)."""
    folder = tmp_path_factory.mktemp(name)
    code, _, err = run_once_in_process(["-m", *SWEEP, *overrides, "hydra.sweep.dir=sweep"],
                                       folder)
    assert code == 0, err
    return folder / "sweep"


@pytest.fixture(scope="module")
def bins_sweep(tmp_path_factory) -> Path:
    """A real `dptrain -m` over two sigmas of balls-in-bins runs of 2 epochs (6 steps each)."""
    return _sweep(tmp_path_factory, "bins", ["privacy.sampling=balls_in_bins",
                                             "privacy.noise_multiplier=1,2", "train.epochs=2"])


@pytest.fixture(scope="module")
def mixed_sweep(tmp_path_factory) -> Path:
    """A real `dptrain -m` over the sampling: a Poisson job and a balls-in-bins job (1 epoch)."""
    return _sweep(tmp_path_factory, "mixed", ["privacy.sampling=poisson,balls_in_bins",
                                              "privacy.noise_multiplier=1", "train.epochs=1"])


# ------------------------------------------------------------------ first principles
def _partitions(n: int, largest: int | None = None):
    """Every partition of n as a non-increasing tuple of parts."""
    largest = n if largest is None else largest
    if n == 0:
        yield ()
        return
    for part in range(min(n, largest), 0, -1):
        for rest in _partitions(n - part, part):
            yield (part, *rest)


@lru_cache(maxsize=None)
def _remove_rdp(sigma: float, k: int, order: int) -> float:
    """D_a(P||Q) of one epoch, P = (1/k) sum_j N(e_j, sigma^2 I_k), Q = N(0, sigma^2 I_k):
    E_Q[L^a] = k^-a sum over (n_1..n_k) summing to a of a!/prod n_j! prod e^(n_j (n_j-1)/(2 s^2)),
    summed by partition (its arrangements over the k steps counted once)."""
    logs = []
    for parts in _partitions(order):
        if len(parts) > k:
            continue
        counts = np.unique(parts, return_counts=True)[1]
        arrangements = (special.gammaln(k + 1) - special.gammaln(k - len(parts) + 1)
                        - special.gammaln(counts + 1).sum())
        multinomial = special.gammaln(order + 1) - sum(special.gammaln(p + 1) for p in parts)
        logs.append(arrangements + multinomial + sum(p * (p - 1) for p in parts) / (2 * sigma**2))
    return float((special.logsumexp(logs) - order * math.log(k)) / (order - 1))


def _poisson_rdp(sigma: float, q: float, order: int) -> float:
    """RDP of one Poisson-subsampled Gaussian step at an integer order (binomial expansion)."""
    i = np.arange(order + 1)
    terms = (special.gammaln(order + 1) - special.gammaln(i + 1) - special.gammaln(order - i + 1)
             + i * math.log(q) + (order - i) * math.log1p(-q) + i * (i - 1) / (2 * sigma**2))
    return float(special.logsumexp(terms) / (order - 1))


def _tight_epsilon(curve: dict[int, float], delta: float) -> float:
    """min over orders a of rdp(a) + log(1 - 1/a) - (log delta + log a) / (a - 1)."""
    return min(r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
               for a, r in curve.items())


def _job(sweep_dir: Path, name: str) -> tuple[dict, list]:
    ledger = read_json(sweep_dir / name / "privacy_ledger.json")
    return ledger, history_from_json(ledger["history"])


def _bins_remove_curve(history: list) -> dict[int, float]:
    """The remove direction of a balls-in-bins history of one sigma: epochs x one epoch's."""
    ((sigma, q, steps),) = history
    k = steps_per_epoch(q)
    return {a: math.ceil(steps / k) * _remove_rdp(sigma, k, a) for a in ORDERS}


# ------------------------------------------------------------------ a balls-in-bins sweep
def test_a_balls_in_bins_sweep_composes_its_jobs_by_random_allocation(bins_sweep):
    """Before: `unknown: job(s) 0, 1 did not use Poisson sampling`."""
    jobs = [_job(bins_sweep, name) for name in ("0", "1")]
    assert [ledger["mechanism"]["sampling"] for ledger, _ in jobs] == ["balls_in_bins"] * 2
    assert [h for _, h in jobs] == [[(1.0, 1 / 6, 12)], [(2.0, 1 / 6, 12)]]
    cost = read_json(bins_sweep / SWEEP_LEDGER_FILENAME)
    composed = cost["cost"]["all_composed"]
    epsilons = [ledger["epsilon"] for ledger, _ in jobs]
    assert composed["accountant"] == "rdp" and cost["epsilon"] == composed["epsilon"]
    assert max(epsilons) <= composed["epsilon"] <= sum(epsilons)
    curves = [_bins_remove_curve(h) for _, h in jobs]
    remove = _tight_epsilon({a: sum(c[a] for c in curves) for a in ORDERS}, 1e-5)
    assert composed["epsilon"] == pytest.approx(remove, rel=1e-9)
    add = sum(random_allocation.rdp_add(s, 6, 2) for s in (1.0, 2.0))
    assert rdp_to_epsilon(add, random_allocation.ADD_ORDERS, 1e-5)[0] < remove


def test_the_balls_in_bins_sweep_ledger_verifies_and_an_edited_total_does_not(bins_sweep,
                                                                               tmp_path):
    assert ledger_main([str(bins_sweep)]) == 0 and verify_sweep_ledger(bins_sweep).ok
    copy = tmp_path / "sweep"
    shutil.copytree(bins_sweep, copy)
    ledger = read_json(copy / SWEEP_LEDGER_FILENAME)
    ledger["epsilon"] = ledger["cost"]["all_composed"]["epsilon"] = max(
        job["epsilon"] for job in ledger["jobs"])
    (copy / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    assert not verify_sweep_ledger(copy).ok


def test_a_version_1_sweep_ledger_that_stated_a_balls_in_bins_sweep_unknown_still_verifies(
        bins_sweep, tmp_path):
    """Version 1 composed Poisson jobs only: its unknown claims nothing, so it is no mismatch,
    and the verifier says what the jobs now compose to; a current ledger must state it."""
    copy = tmp_path / "sweep"
    shutil.copytree(bins_sweep, copy)
    ledger = read_json(copy / SWEEP_LEDGER_FILENAME)
    composed = ledger["cost"]["all_composed"]
    ledger.update(schema_version=1, epsilon=None)
    composed.update(epsilon=None, accountant="prv",
                    reason="unknown: job(s) 0, 1 did not use Poisson sampling, and the sweep's "
                           "costs are composed for Poisson-sampled histories only")
    composed.pop("composition", None)
    (copy / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    verification = verify_sweep_ledger(copy)
    assert verification.ok and "states unknown" in verification.message
    ledger["schema_version"] = 2
    (copy / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    assert not verify_sweep_ledger(copy).ok


# ------------------------------------------------------------------ Poisson and balls-in-bins
def test_a_sweep_of_a_poisson_job_and_a_balls_in_bins_job_composes_both(mixed_sweep):
    """Before: unknown. Both curves bound the two directions' sum: Poisson's curve holds for
    either direction (Mironov, Talwar, Zhang 2019), random allocation's remove direction is the
    larger here."""
    (poisson, p_history), (bins, b_history) = (_job(mixed_sweep, n) for n in ("0", "1"))
    assert (poisson["mechanism"]["sampling"], bins["mechanism"]["sampling"]) == \
        ("poisson", "balls_in_bins")
    ((sigma, q, steps),) = p_history
    bins_curve = _bins_remove_curve(b_history)
    curve = {a: steps * _poisson_rdp(sigma, q, a) + bins_curve[a] for a in ORDERS}
    composed = read_json(mixed_sweep / SWEEP_LEDGER_FILENAME)["cost"]["all_composed"]
    assert composed["epsilon"] == pytest.approx(_tight_epsilon(curve, 1e-5), rel=1e-9)
    assert max(poisson["epsilon"], bins["epsilon"]) <= composed["epsilon"] <= \
        poisson["epsilon"] + bins["epsilon"]
    assert verify_sweep_ledger(mixed_sweep).ok


def _ledger(job_dir: Path, history: list, sampling: str) -> None:
    """A finished private ledger (prv, delta 1e-5) whose mechanism names `sampling`."""
    ledger = PrivacyLedger.create(job_dir, config={}, dataset_name="digits", dataset_size=1000,
                                  mechanism={"algorithm": "DP-SGD", "sampling": sampling},
                                  accountant="prv", target_epsilon=None, delta=1e-5)
    ledger.finish("completed", history, sum(n for _, _, n in history))


def test_a_shuffled_job_beside_balls_in_bins_jobs_keeps_the_cost_unknown_and_says_why(
        bins_sweep, tmp_path):
    shutil.copytree(bins_sweep / "0", tmp_path / "0")
    _ledger(make_job(tmp_path, "1", ["privacy.sampling=shuffle"], done(1.0, 0.5)),
            [(1.0, 1 / 6, 12)], "shuffle")
    composed = sweep_cost(tmp_path)["cost"]["all_composed"]
    assert composed["epsilon"] is None
    reason = composed["reason"]
    assert "job(s) 1: its epsilon is stated for substitution" in reason
    assert "job(s) 0" not in reason and "poisson or balls_in_bins" in reason


# ------------------------------------------------------------------ random stopping
def test_random_stopping_over_a_balls_in_bins_grid_bounds_each_trial_by_both_directions(
        bins_sweep, tmp_path):
    """`dptrain tune` over the two sigmas drew the cheap one: the per-trial curve is the larger
    of the two directions of the costlier grid point (before: unknown, not Poisson)."""
    grid = [["privacy.noise_multiplier=1"], ["privacy.noise_multiplier=2"]]
    histories = [_job(bins_sweep, name)[1] for name in ("0", "1")]
    shutil.copytree(bins_sweep / "1", tmp_path / "0")
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(f"- {grid[1][0]}\n")
    (tmp_path / TUNING_FILENAME).write_text(json.dumps({
        "trials": {"distribution": "poisson", "mean_trials": 2.0}, "grid": grid,
        "jobs": [{"job": "0", "overrides": grid[1]}],
        "grid_costs": [{"overrides": point, "history": history_to_json(history),
                        "sampling": "balls_in_bins"} for point, history in zip(grid, histories)]}))
    stopping = sweep_cost(tmp_path)["cost"]["random_stopping"]
    orders = random_allocation.ADD_ORDERS
    costly = random_allocation.rdp(1.0, 6, 2, orders)
    assert np.all(costly >= random_allocation.rdp(2.0, 6, 2, orders))
    expected = rdp_to_epsilon(rdp_repeat_and_select(costly, orders, poisson_trials(2.0)), orders,
                              1e-5)[0]
    assert stopping["epsilon"] == pytest.approx(expected, rel=1e-9)
    cheap = random_allocation.rdp(2.0, 6, 2, orders)
    assert stopping["epsilon"] > rdp_to_epsilon(
        rdp_repeat_and_select(cheap, orders, poisson_trials(2.0)), orders, 1e-5)[0]
