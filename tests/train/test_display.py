"""What a run shows while it trains and evaluates, and its closing summary."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from test_trainer_support import make_job, make_settings

from dptrain.formatting import format_epsilon
from dptrain.train import display
from dptrain.train.display import Display, privacy_rows
from dptrain.train.ledger import PRIVACY_UNIT, PrivacyLedger
from dptrain.train.loop import train

EPOCH_LINE = re.compile(r"epoch (\d)/3: private \(not covered by epsilon\): loss [0-9.]+, "
                        r"accuracy [0-9.]+%; test accuracy [0-9.]+%, epsilon so far [0-9.]+, "
                        r"[0-9.]+ s")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dptrain.train"]


def test_without_bars_each_epoch_line_labels_the_loss_and_accuracy_private(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dptrain.train"):
        train(make_job(), make_settings(tmp_path, epochs=3, progress=False))
    epochs = [m.group(1) for line in _lines(caplog) if (m := EPOCH_LINE.fullmatch(line))]
    assert epochs == ["1", "2", "3"]


def test_without_bars_a_phase_longer_than_the_interval_reports_its_progress(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(display, "PROGRESS_EVERY_S", 0.0)   # every phase is "long"
    with caplog.at_level(logging.INFO, logger="dptrain.train"):
        train(make_job(), make_settings(tmp_path, epochs=1, progress=False))
    lines = _lines(caplog)
    assert any(line.startswith("epoch 1/1: step 4/4, private loss ") for line in lines)
    assert any(line.startswith("evaluating the test split: batch 2/2, ") for line in lines)


def test_on_a_terminal_the_evaluation_shows_a_progress_bar_and_no_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")   # rich treats the captured output as a terminal
    with caplog.at_level(logging.INFO, logger="dptrain.train"):
        train(make_job(), make_settings(tmp_path, epochs=1, progress=True))
    assert "evaluating the test split" in capsys.readouterr().out
    assert not any(EPOCH_LINE.fullmatch(line) for line in _lines(caplog))


def test_a_script_without_logging_configured_still_sees_the_epoch_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    train(make_job(), make_settings(tmp_path, epochs=1, progress=False))
    assert re.search(r"^epoch 1/1: private \(not covered by epsilon\): loss ",
                     capsys.readouterr().out, flags=re.M)


def _ledger(tmp_path: Path, claims: dict[str, float], target: float | None) -> PrivacyLedger:
    ledger = PrivacyLedger.create(tmp_path, config={}, dataset_name="digits", dataset_size=10,
                                  mechanism={"randomness": "os_entropy"}, accountant="prv",
                                  target_epsilon=target, delta=1e-5, synthetic=True)
    ledger.data["epsilon"] = claims["prv"]
    ledger.data["epsilon_by_accountant"] = {
        name: {"epsilon": value, "approximate": name == "gdp"} for name, value in claims.items()}
    return ledger


def test_the_summary_lists_each_accountant_once_and_explains_a_looser_bound_above_the_target(
        tmp_path: Path) -> None:
    rows = dict(privacy_rows(_ledger(tmp_path, {"gdp": 2.8, "prv": 2.99, "rdp": 3.3}, 3.0)))
    assert [label for label in rows if "prv" in label] == ["epsilon (prv)"]
    assert rows["epsilon (prv)"] == ("2.99 at delta=1e-05 (upper bound up to an estimated FFT "
                                     "round-off)")
    assert rows["  epsilon under rdp"] == ("3.30 (upper bound): above the target 3, a looser bound "
                                           "than prv's, the accountant the run is calibrated and "
                                           "capped with")
    assert rows["  epsilon under gdp"] == "2.80 (approximation (CLT), not an upper bound)"
    assert rows["privacy unit"] == PRIVACY_UNIT and "add/remove" in PRIVACY_UNIT


def test_the_summary_names_the_sampling_clipping_and_noise_of_the_mechanism(tmp_path: Path) -> None:
    """Banded noise with cyclic Poisson must not read as plain DP-SGD."""
    ledger = _ledger(tmp_path, {"prv": 2.99}, 3.0)
    ledger.data["mechanism"].update(
        algorithm="DP-MF (banded matrix factorization)", sampling="cyclic_poisson",
        sample_rate=0.0625, clipping="flat", max_grad_norm=1.0,
        noise="correlated gaussian (banded Toeplitz)", noise_multiplier=1.25)
    assert dict(privacy_rows(ledger))["mechanism"] == (
        "DP-MF (banded matrix factorization): cyclic_poisson sampling (q = 0.0625), flat clipping "
        "at C = 1, correlated gaussian (banded Toeplitz) noise with sigma = 1.25")


def test_the_summary_flags_synthetic_data_and_fits_80_columns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    run = tmp_path / ("a_run_folder_with_a_long_name_" * 3)
    job = make_job()
    result = train(job, make_settings(run, epochs=1, progress=False))
    capsys.readouterr()
    ledger = PrivacyLedger(run / "privacy_ledger.json", {**_ledger(tmp_path, {"prv": 1.0}, None).data})
    Display(False).summary(result, ledger)
    out = capsys.readouterr().out
    assert "SYNTHETIC random data" in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "".join(re.findall(r"│ ([^│]*?) *│$", out, flags=re.M)).count("a_run_folder_with") >= 6


def test_a_progress_line_shows_the_epsilon_of_the_steps_taken_not_of_the_block_committed_ahead(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from dptrain.train.budget import epsilon_of
    from dptrain.train.ledger import load_ledger

    monkeypatch.setattr(display, "PROGRESS_EVERY_S", 0.0)   # a line after every step
    with caplog.at_level(logging.INFO, logger="dptrain.train"):
        train(make_job(), make_settings(tmp_path, epochs=1, progress=False))
    ledger = load_ledger(tmp_path)
    sigma, q, _ = ledger["history"][0]["noise_multiplier"], ledger["history"][0]["sample_rate"], 0
    shown = {int(m.group(1)): float(m.group(2)) for line in _lines(caplog)
             if (m := re.match(r"epoch 1/1: step (\d)/4, .*epsilon so far ([0-9.]+)", line))}
    assert set(shown) == {1, 2, 3, 4}
    for step, epsilon in shown.items():
        expected = epsilon_of([(sigma, q, step)], ledger["delta"], ledger["accountant"])
        # rounded up to 3 digits (dptrain.formatting), from an accountant's float
        low, high = (float(format_epsilon(expected * (1 + d))) for d in (-1e-6, 1e-6))
        assert low <= epsilon <= high
