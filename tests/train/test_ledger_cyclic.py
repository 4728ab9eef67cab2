"""The ledger of a cyclic Poisson run: its plan's groups and its charge (sensitivity,
participation schema) are recorded, `dptrain-ledger` recomputes the epsilon from them, and a
resume that would shift its steps against their groups is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_support import final_weights, make_job, make_settings, resume_after_a_crash_is_refused

from dptrain.accounting import compute_epsilon
from dptrain.accounting.events import AccountingEvent
from dptrain.accounting.gdp import gdp_epsilon
from dptrain.accounting.matrix_factorization import (
    amplified_history,
    cyclic_participation,
    sensitivity,
    unamplified_mu,
)
from dptrain.data.cyclic_sampling import equal_split
from dptrain.errors import ConfigError
from dptrain.privacy.noise import Banded, Blt
from dptrain.train.ledger import (
    CYCLIC_PARTITION_NOTE,
    EQUAL_SPLIT_PARTITION_NOTE,
    PRIVACY_UNIT,
    ZERO_OUT_PRIVACY_UNIT,
    carry_partition,
    history_from_json,
    load_ledger,
    verify_ledger,
)
from dptrain.train import checkpoint as ckpt
from dptrain.train.loop import train

CYCLIC = {"sampling": "cyclic_poisson", "sampling_groups": 3}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cyclic")
    train(make_job(engine_kwargs=CYCLIC), make_settings(folder, epochs=2))
    return folder


def _edited(run_dir: Path, tmp_path: Path, edit) -> Path:
    data = json.loads((run_dir / "privacy_ledger.json").read_text())
    edit(data)
    (tmp_path / "privacy_ledger.json").write_text(json.dumps(data))
    return tmp_path


def test_the_ledger_records_the_groups_and_the_amplified_charge(run_dir: Path) -> None:
    data = load_ledger(run_dir)
    steps = sum(run["steps"] for run in data["history"])
    assert data["plan"]["selection"]["kind"] == "cyclic_poisson"
    assert data["plan"]["selection"]["groups"] == 3
    assert data["accounting"] == {
        "selection": "cyclic_poisson", "groups": 3, "relation": "add/remove", "amplified": True,
        "sensitivity": 1.0,
        "participation": {"kind": "cyclic_poisson", "groups": 3, "rounds": -(-steps // 3)}}


def test_the_ledger_states_add_remove_and_that_each_examples_group_was_drawn_independently(
        run_dir: Path) -> None:
    mechanism = load_ledger(run_dir)["mechanism"]
    assert mechanism["privacy_unit"] == PRIVACY_UNIT and "add/remove" in PRIVACY_UNIT
    assert mechanism["sampling_partition"] == CYCLIC_PARTITION_NOTE


@pytest.mark.parametrize("previous_partition", [None, EQUAL_SPLIT_PARTITION_NOTE])
def test_resuming_a_run_begun_with_equal_groups_keeps_saying_zero_out_not_add_remove(
        run_dir: Path, previous_partition: str | None) -> None:
    # a ledger written before groups were drawn independently records no sampling_partition;
    # its checkpoints keep the equal split (tests/data/test_cyclic_sampling.py)
    previous = dict(load_ledger(run_dir)["mechanism"])
    del previous["sampling_partition"]
    if previous_partition is not None:                     # resumed once already
        previous.update(sampling_partition=previous_partition,
                        privacy_unit=ZERO_OUT_PRIVACY_UNIT)
    mechanism = dict(load_ledger(run_dir)["mechanism"])
    carry_partition(previous, mechanism)
    assert mechanism["sampling_partition"] == EQUAL_SPLIT_PARTITION_NOTE
    assert mechanism["privacy_unit"] == ZERO_OUT_PRIVACY_UNIT
    current = dict(load_ledger(run_dir)["mechanism"])
    carry_partition(load_ledger(run_dir)["mechanism"], current)   # a run begun independent
    assert current == load_ledger(run_dir)["mechanism"]


def test_the_verifier_recomputes_the_epsilon_of_the_groups_rounds(run_dir: Path) -> None:
    data = load_ledger(run_dir)
    history = history_from_json(data["history"])
    result = verify_ledger(run_dir)
    expected = compute_epsilon(history, data["delta"], "rdp",
                               AccountingEvent("cyclic_poisson", 3))
    assert result.ok and result.recomputed == expected == data["epsilon"]
    assert expected != compute_epsilon(history, data["delta"], "rdp")   # not Poisson's


def test_a_ledger_whose_groups_were_edited_fails_verification(run_dir: Path,
                                                              tmp_path: Path) -> None:
    def fewer_groups(data):
        data["plan"]["selection"]["groups"] = 2
    result = verify_ledger(_edited(run_dir, tmp_path, fewer_groups))
    assert not result.ok and "MISMATCH" in result.message


def test_a_ledger_whose_recorded_sensitivity_was_edited_fails_verification(
        run_dir: Path, tmp_path: Path) -> None:
    def smaller(data):
        data["accounting"]["sensitivity"] = 0.5
    result = verify_ledger(_edited(run_dir, tmp_path, smaller))
    assert not result.ok and "accounting" in result.message


def test_a_resume_that_would_charge_steps_out_of_their_groups_is_refused(tmp_path: Path) -> None:
    resume_after_a_crash_is_refused(tmp_path, CYCLIC, "sampling group")


def test_a_cyclic_run_resumed_from_a_checkpoint_replays_its_groups_exactly(tmp_path: Path) -> None:
    whole = make_job(engine_kwargs=CYCLIC)
    train(whole, make_settings(tmp_path / "whole", epochs=3))
    train(make_job(engine_kwargs=CYCLIC), make_settings(tmp_path / "resumed", epochs=3))
    resumed = make_job(engine_kwargs=CYCLIC)
    train(resumed, make_settings(tmp_path / "resumed", epochs=3,
                                 resume=str(tmp_path / "resumed" / "checkpoints" / "epoch_1.pt")))
    assert all(torch.equal(a, b) for a, b in zip(final_weights(resumed).values(),
                                                 final_weights(whole).values()))
    assert load_ledger(tmp_path / "resumed")["history"] == load_ledger(tmp_path / "whole")["history"]


def test_a_run_begun_with_equal_groups_resumes_with_them_and_its_ledger_says_zero_out(
        tmp_path: Path) -> None:
    # what a run started before groups were drawn independently left: its checkpoint's sampler
    # state has a partition seed and no "partition", its ledger no sampling_partition
    folder = tmp_path / "legacy"
    train(make_job(engine_kwargs=CYCLIC), make_settings(folder, epochs=2))
    checkpoint = folder / "checkpoints" / "epoch_1.pt"
    state = ckpt.load_checkpoint(checkpoint)
    sampler = state["engine"]["engine"]["sampler"]
    del sampler["partition"], sampler["partition_sha256"]
    ckpt.save_checkpoint(checkpoint, state)
    ledger = json.loads((folder / "privacy_ledger.json").read_text())
    del ledger["mechanism"]["sampling_partition"]
    (folder / "privacy_ledger.json").write_text(json.dumps(ledger))
    resumed = make_job(engine_kwargs=CYCLIC)
    with pytest.warns(UserWarning, match="equal split.*zero-out"):
        train(resumed, make_settings(folder, epochs=3, resume=str(checkpoint)))
    groups = resumed.engine.data_loader.poisson_sampler
    assert torch.equal(groups.group_of, equal_split(groups.num_samples, 3,
                                                    sampler["partition_seed"]))
    mechanism = load_ledger(folder)["mechanism"]
    assert mechanism["privacy_unit"] == ZERO_OUT_PRIVACY_UNIT
    assert mechanism["sampling_partition"] == EQUAL_SPLIT_PARTITION_NOTE


# -- correlated noise: the strategy's parameters, its sensitivity and participation schema ------
CORRELATED = {"banded": Banded((1.0, 0.5, 0.25)), "blt": Blt((0.9,), (0.3,))}


@pytest.fixture(scope="module", params=sorted(CORRELATED))
def correlated_run(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    train(make_job(engine_kwargs={"noise_strategy": CORRELATED[request.param]}),
          make_settings(folder, epochs=2))
    return request.param, folder


def test_a_correlated_runs_ledger_records_its_strategy_sensitivity_and_participation(
        correlated_run: tuple[str, Path]) -> None:
    name, folder = correlated_run
    data = load_ledger(folder)
    strategy, steps = CORRELATED[name], sum(run["steps"] for run in data["history"])
    groups = data["plan"]["selection"]["groups"]
    assert data["plan"]["noise"]["strategy"] == strategy.to_dict()
    assert data["plan"]["selection"]["kind"] == "cyclic_poisson"
    if name == "banded":
        assert groups == 3 and data["accounting"]["amplified"]
        assert data["accounting"]["sensitivity"] == pytest.approx(1.0)
    else:
        history = history_from_json(data["history"])
        schema = cyclic_participation(history, groups)
        assert not data["accounting"]["amplified"]
        assert data["accounting"]["participation"] == schema.to_dict()
        assert data["accounting"]["sensitivity"] == sensitivity(
            strategy.toeplitz_column(steps), schema) > 1.0


def test_a_correlated_runs_ledger_names_its_algorithm_and_noise_not_dp_sgd(
        correlated_run: tuple[str, Path]) -> None:
    name, folder = correlated_run
    mechanism = load_ledger(folder)["mechanism"]
    assert mechanism["algorithm"].startswith("DP-MF") and mechanism["noise"] != "gaussian"
    assert mechanism["noise"].startswith("correlated gaussian")


def test_the_verifier_recomputes_a_correlated_runs_epsilon_from_its_column(
        correlated_run: tuple[str, Path]) -> None:
    name, folder = correlated_run
    data = load_ledger(folder)
    history = history_from_json(data["history"])
    steps = sum(n for _, _, n in history)
    groups = data["plan"]["selection"]["groups"]
    column = CORRELATED[name].toeplitz_column(steps)
    if name == "banded":
        expected = compute_epsilon(amplified_history(history, groups, column), data["delta"],
                                   "rdp")
    else:
        mu = unamplified_mu(history, column, cyclic_participation(history, groups), 1.0)
        expected = gdp_epsilon(mu, data["delta"])
    result = verify_ledger(folder)
    assert result.ok and result.recomputed == data["epsilon"] == pytest.approx(expected,
                                                                              rel=1e-12)
    assert expected != pytest.approx(compute_epsilon(history, data["delta"], "rdp"), rel=0.01)


def test_a_ledger_whose_noise_strategy_was_edited_fails_verification(
        correlated_run: tuple[str, Path], tmp_path: Path) -> None:
    name, folder = correlated_run

    def other_strategy(data):  # banded: one band more than its groups; BLT: half its correlation
        strategy = data["plan"]["noise"]["strategy"]
        if name == "banded":
            strategy["coefficients"].append(0.1)
        else:
            strategy["output_scale"] = [v / 2 for v in strategy["output_scale"]]
    edited = _edited(folder, tmp_path, other_strategy)
    if name == "banded":  # the recorded plan itself no longer holds
        with pytest.raises(ConfigError, match="noise=banded with 4 bands"):
            verify_ledger(edited)
    else:
        assert not verify_ledger(edited).ok
