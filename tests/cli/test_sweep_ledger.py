"""The cost of releasing the best job of a sweep: `sweep_ledger.json` (dptrain.cli.sweep_ledger),
written at the end of a real `dptrain -m` sweep and verified by `dptrain-ledger SWEEP_FOLDER`."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from test_cli_sweep_summary import done, make_job

import dptrain.report
from dptrain.accounting.history import history_from_json
from dptrain.accounting.tuning import composed_epsilon
from dptrain.cli.ledger_cmd import main as ledger_main
from dptrain.cli.report import sweep_report
from dptrain.cli.sweep_ledger import SWEEP_LEDGER_FILENAME, sweep_cost, verify_sweep_ledger
from dptrain.train.ledger import PrivacyLedger
from dptrain_runner import QUIET, read_json, run_once_in_process
from dptrain.formatting import format_epsilon

SIGMAS = (1.0, 2.0)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, str]:
    """A real two-job sweep over sigma (digits, one epoch of 6 steps), run as `dptrain -m`:
    (its sweep folder, what it printed)."""
    folder = tmp_path_factory.mktemp("sweep")
    code, out, err = run_once_in_process(["-m", "privacy=sigma", "privacy.noise_multiplier=1,2",
                                          "train.epochs=1", "train.batch_size=256",
                                          "hydra.sweep.dir=sweep", *QUIET], folder)
    assert code == 0, err
    return folder / "sweep", out


def _job_histories(sweep_dir: Path) -> list[list]:
    return [history_from_json(read_json(sweep_dir / str(n) / "privacy_ledger.json")["history"])
            for n in range(len(SIGMAS))]


def test_a_sweep_states_that_its_best_job_costs_every_job_composed(sweep):
    sweep_dir, printed = sweep
    ledger = read_json(sweep_dir / SWEEP_LEDGER_FILENAME)
    composed = composed_epsilon(_job_histories(sweep_dir), 1e-5, "prv")
    assert ledger["epsilon"] == pytest.approx(composed, rel=1e-9)
    assert ledger["cost"]["all_composed"]["accountant"] == "prv"
    jobs = read_json(sweep_dir / "sweep_summary.json")["jobs"]
    assert composed > max(job["epsilon"] for job in jobs)
    summary_cost = read_json(sweep_dir / "sweep_summary.json")["cost_of_best"]
    assert summary_cost["epsilon"] == ledger["epsilon"] and summary_cost["selection"]["rule"] == "all"
    assert f"releasing the best job costs epsilon {format_epsilon(composed)}" in " ".join(printed.split())


def test_the_sweep_ledger_records_each_jobs_ledger_history_hash_and_epsilon(sweep):
    sweep_dir, _ = sweep
    entries = read_json(sweep_dir / SWEEP_LEDGER_FILENAME)["jobs"]
    assert [e["ledger"] for e in entries] == ["0/privacy_ledger.json", "1/privacy_ledger.json"]
    claims = [read_json(sweep_dir / e["ledger"])["epsilon"] for e in entries]
    assert [e["epsilon"] for e in entries] == claims
    assert all(len(e["history_sha256"]) == 64 for e in entries)


def test_the_privacy_utility_plot_states_the_cost_of_the_best_job(sweep, monkeypatch, tmp_path):
    sweep_dir, _ = sweep
    notes: list[str] = []
    original = dptrain.report.plot_sweep
    monkeypatch.setattr(dptrain.report, "plot_sweep",
                        lambda *a, **k: notes.append(k["note"]) or original(*a, **k))
    sweep_report(sweep_dir, tmp_path / "plot.png")
    epsilon = read_json(sweep_dir / SWEEP_LEDGER_FILENAME)["epsilon"]
    assert notes and f"releasing the best job costs epsilon {format_epsilon(epsilon)}" in notes[0]


def test_dptrain_ledger_verifies_the_sweep_ledger_from_the_jobs_ledgers(sweep, capsys):
    sweep_dir, _ = sweep
    assert ledger_main([str(sweep_dir)]) == 0
    assert "sweep ledgers" in capsys.readouterr().out
    assert verify_sweep_ledger(sweep_dir).ok


def test_dptrain_ledger_fails_when_the_sweep_ledgers_total_is_edited_down(sweep, tmp_path, capsys):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep[0], copy)
    ledger = read_json(copy / SWEEP_LEDGER_FILENAME)
    lowest = min(job["epsilon"] for job in ledger["jobs"])
    ledger["epsilon"] = ledger["cost"]["all_composed"]["epsilon"] = lowest
    (copy / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    assert ledger_main([str(copy)]) == 1
    assert "MISMATCH" in " ".join(capsys.readouterr().out.split())
    assert ledger_main([str(copy), "--json"]) == 1


def test_dptrain_ledger_fails_when_a_job_of_the_sweep_is_left_out_of_its_ledger(sweep, tmp_path):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep[0], copy)
    ledger = read_json(copy / SWEEP_LEDGER_FILENAME)
    ledger["jobs"] = ledger["jobs"][:1]
    (copy / SWEEP_LEDGER_FILENAME).write_text(json.dumps(ledger))
    assert not verify_sweep_ledger(copy).ok


# ------------------------------------------------------------------ hand-made job folders
def _ledger(job_dir: Path, history: list | None, sampling: str = "poisson") -> None:
    """A finished ledger in `job_dir`: private with `history` (rdp, delta 1e-5; its batches
    selected by `sampling`), or non-private."""
    private = history is not None
    mechanism = {"algorithm": "DP-SGD", "sampling": sampling}
    ledger = PrivacyLedger.create(job_dir, config={}, dataset_name="digits", dataset_size=1000,
                                  mechanism=mechanism if private else None,
                                  accountant="rdp" if private else None, target_epsilon=None,
                                  delta=1e-5 if private else None)
    steps = sum(n for _, _, n in history or [])
    ledger.finish("completed", history or [], steps or 5)


def test_a_job_without_a_ledger_took_no_step_and_costs_nothing(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    make_job(tmp_path, "1", ["a=1"], None)
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] == pytest.approx(composed_epsilon([[(1.0, 0.1, 10)]], 1e-5, "rdp"))
    assert cost["jobs"][1]["ledger"] is None


def test_a_non_private_job_makes_releasing_the_best_job_cost_infinite(tmp_path):
    _ledger(make_job(tmp_path, "0", ["privacy=sigma"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    _ledger(make_job(tmp_path, "1", ["privacy=none"], done(None, 0.9)), None)
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] == math.inf and "1" in cost["cost"]["all_composed"]["reason"]


def test_a_job_that_trained_but_lost_its_ledger_makes_the_cost_unknown_not_smaller(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    make_job(tmp_path, "1", ["a=1"], done(1.0, 0.5))      # result.json: 10 steps, no ledger
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] is None and "no privacy_ledger.json" in cost["jobs"][1]["error"]


def test_an_unreadable_job_ledger_makes_the_cost_unknown_not_smaller(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    job = make_job(tmp_path, "1", ["a=1"], done(1.0, 0.5))
    (job / "privacy_ledger.json").write_text("{ torn")
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] is None and "cannot be read" in cost["cost"]["all_composed"]["reason"]


def test_a_job_with_correlated_noise_makes_the_cost_unknown_not_composed_as_poisson_steps(
        tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    correlated = make_job(tmp_path, "1", ["a=1"], done(1.0, 0.5))
    _ledger(correlated, [(1.0, 0.1, 10)])
    path = correlated / "privacy_ledger.json"
    data = json.loads(path.read_text())
    data["accounting"] = {"selection": "poisson", "groups": 1, "relation": "add/remove",
                          "amplified": False, "sensitivity": 3.2}
    path.write_text(json.dumps(data))
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] is None
    assert "job(s) 1: its ledger records a charge with no per-run curve to compose" in \
        cost["cost"]["all_composed"]["reason"]


def test_a_shuffled_job_makes_the_cost_unknown_not_composed_as_poisson_steps(tmp_path):
    _ledger(make_job(tmp_path, "0", ["a=0"], done(1.0, 0.5)), [(1.0, 0.1, 10)])
    _ledger(make_job(tmp_path, "1", ["a=1"], done(1.0, 0.5)), [(1.0, 0.1, 10)], "shuffle")
    cost = sweep_cost(tmp_path)
    assert cost["epsilon"] is None
    assert "job(s) 1: its epsilon is stated for substitution" in \
        cost["cost"]["all_composed"]["reason"]


def test_the_cost_sentence_states_each_figure_once(sweep):
    from dptrain.cli.sweep_ledger import describe_cost

    sweep_dir, _ = sweep
    ledger = read_json(sweep_dir / SWEEP_LEDGER_FILENAME)
    text = describe_cost(ledger, 2)
    assert text.count(format_epsilon(ledger['epsilon'])) == 1 and "2 jobs composed" in text
