"""`dptrain-privacy`: both directions, every accountant, JSON output, one-line errors."""

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

import pytest

from dptrain.accounting import compute_epsilon
from dptrain.cli.plan import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`dptrain-privacy ARGS` in a new interpreter (for the real exit status and stderr)."""
    return subprocess.run([sys.executable, "-m", "dptrain.cli.plan", *args],
                          capture_output=True, text=True, timeout=120)


@dataclass
class Done:
    """What `dptrain-privacy ARGS` did, as `subprocess.CompletedProcess` names it."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def dptrain_privacy(capsys: pytest.CaptureFixture[str]) -> Callable[..., Done]:
    """`dptrain-privacy ARGS` through its entry point in this process (no interpreter start-up)."""

    def call(*args: str) -> Done:
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return call


def results_by_name(proc: Done) -> dict:
    assert proc.returncode == 0, proc.stderr
    return {row["accountant"]: row for row in json.loads(proc.stdout)["results"]}


def test_epsilon_command_prints_a_table_with_every_accountant(dptrain_privacy):
    proc = dptrain_privacy("epsilon", "--sigma", "1.1", "--sample-rate", "0.004", "--steps",
                           "1000", "--delta", "1e-5")
    assert proc.returncode == 0, proc.stderr
    for name in ("prv", "rdp", "gdp"):
        assert name in proc.stdout
    assert "approximation" in proc.stdout


def test_each_accountant_is_described_in_the_words_of_its_guarantee(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["epsilon", "--sigma", "1.1", "--sample-rate", "0.004", "--steps", "1000",
                 "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "upper bound up to an estimated FFT round-off; true epsilon in [" in out
    assert "approximation (CLT), not an upper bound" in out and "certified" not in out


def test_epsilon_json_matches_compute_epsilon_for_each_accountant(dptrain_privacy):
    proc = dptrain_privacy("epsilon", "--sigma", "1.1", "--sample-rate", "0.004", "--steps",
                           "1000", "--delta", "1e-5", "--accountant", "rdp", "prv", "--json")
    rows = results_by_name(proc)
    assert set(rows) == {"rdp", "prv"}
    for name, row in rows.items():
        assert row["epsilon"] == pytest.approx(compute_epsilon([(1.1, 0.004, 1000)], 1e-5, name))
    assert rows["prv"]["bounds"][0] <= rows["prv"]["epsilon"] == rows["prv"]["bounds"][1]


def test_epochs_with_batch_and_dataset_size_give_sample_rate_and_steps(dptrain_privacy):
    proc = dptrain_privacy("epsilon", "--sigma", "1.0", "--batch-size", "100", "--dataset-size",
                           "10000", "--epochs", "2.5", "--delta", "1e-5", "--accountant", "rdp",
                           "--json")
    assert proc.returncode == 0, proc.stderr
    inputs = json.loads(proc.stdout)["inputs"]
    assert inputs["sample_rate"] == 0.01 and inputs["steps"] == 250


def test_sigma_command_calibrates_below_the_target_per_accountant(dptrain_privacy):
    proc = dptrain_privacy("sigma", "--target-epsilon", "2", "--delta", "1e-5", "--sample-rate",
                           "0.01", "--steps", "500", "--accountant", "rdp", "gdp", "--json")
    rows = results_by_name(proc)
    for name, row in rows.items():
        assert 2 - 0.01 <= row["epsilon"] <= 2
    assert rows["gdp"]["noise_multiplier"] < rows["rdp"]["noise_multiplier"]


def test_zero_sigma_reports_infinite_epsilon_without_crashing(dptrain_privacy):
    proc = dptrain_privacy("epsilon", "--sigma", "0", "--sample-rate", "0.01", "--steps", "10",
                           "--delta", "1e-5", "--json")
    rows = results_by_name(proc)
    assert all(row["epsilon"] == "inf" for row in rows.values())


@pytest.mark.parametrize("args, flag", [
    (["epsilon", "--sigma", "1", "--sample-rate", "1.5", "--steps", "10", "--delta", "1e-5"], "--sample-rate"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "2"], "--delta"),
    (["epsilon", "--sigma", "-1", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"], "--sigma"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.1", "--delta", "1e-5"], "--steps"),
    (["epsilon", "--sigma", "1", "--batch-size", "10", "--steps", "10", "--delta", "1e-5"], "--dataset-size"),
    (["sigma", "--target-epsilon", "1e-9", "--sample-rate", "1", "--steps", "100000", "--delta", "1e-5",
      "--accountant", "rdp"], "target_epsilon"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5",
      "--sampling", "poisson", "--sampling-groups", "2"], "--sampling-groups"),
    (["epsilon", "--sigma", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5",
      "--sampling", "cyclic_poisson", "--sampling-groups", "20"], "--sampling-groups"),
])
def test_bad_input_prints_one_line_error_naming_the_flag_and_exits_2(args, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain-privacy: error:")
    assert flag in lines[0]


def test_bad_input_in_a_real_process_exits_2_without_traceback():
    proc = run_cli("epsilon", "--sigma", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "0")
    assert proc.returncode == 2
    assert proc.stderr.startswith("dptrain-privacy: error: --delta=0.0")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_sigma_rows_keep_the_gdp_approximation_warning(capsys):
    assert main(["sigma", "--target-epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--steps", "100", "--accountant", "gdp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["approximate"] is True and any("not an upper bound" in w for w in row["warnings"])


def test_an_infinite_epsilon_with_some_noise_is_not_blamed_on_zero_noise(capsys):
    assert main(["epsilon", "--sigma", "0.02", "--sample-rate", "0.01", "--steps", "10",
                 "--delta", "1e-5", "--accountant", "gdp"]) == 0
    out = capsys.readouterr().out
    assert "no finite guarantee" in out and "sigma = 0" not in out


def test_without_delta_the_dataset_size_gives_the_delta_dptrain_defaults_to(capsys):
    assert main(["epsilon", "--sigma", "1.1", "--batch-size", "128", "--dataset-size", "1442",
                 "--epochs", "30", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["delta"] == 1e-5


def test_without_delta_or_dataset_size_the_command_asks_for_delta(dptrain_privacy):
    proc = dptrain_privacy("epsilon", "--sigma", "1.1", "--sample-rate", "0.004", "--steps",
                           "1000")
    assert proc.returncode == 2
    assert "give --delta" in proc.stderr and "--dataset-size" in proc.stderr


def test_a_shuffled_plan_is_answered_with_the_composed_gaussian_under_every_accountant(capsys):
    from dptrain.accounting.shuffle import shuffle_epsilon

    assert main(["epsilon", "--sigma", "1.0", "--batch-size", "100", "--dataset-size", "1000",
                 "--epochs", "3", "--sampling", "shuffle", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert {row["epsilon"] for row in rows} == {shuffle_epsilon([(1.0, 0.1, 30)], 1e-4)}


@pytest.mark.parametrize("noise", [["--noise", "banded", "--noise-bands", "4"], ["--noise", "blt"]],
                         ids=["banded", "blt"])
def test_sigma_for_correlated_noise_is_the_one_privacy_epsilon_calibrates(noise, capsys):
    from dptrain.cli.privacy_config import PrivacyGroup
    from dptrain.privacy.plan import calibrated

    assert main(["sigma", "--target-epsilon", "3", "--batch-size", "64", "--dataset-size", "1442",
                 "--epochs", "2", "--accountant", "prv", "--json", *noise]) == 0
    answer = json.loads(capsys.readouterr().out)
    keys = {"noise": noise[1], **({"noise_bands": 4} if noise[1] == "banded" else {})}
    request = PrivacyGroup.parse({"name": "epsilon", "target_epsilon": 3.0, **keys})
    plan = calibrated(request.plan(64 / 1442, 1e-5, steps=46), epochs=2)
    assert answer["inputs"]["sampling"] == "cyclic_poisson"
    assert answer["inputs"]["sampling_groups"] == plan.selection.groups
    assert answer["inputs"]["noise"] == plan.noise.strategy.to_dict()
    assert answer["results"][0]["noise_multiplier"] == plan.noise.multiplier


def test_a_cyclic_poisson_plan_is_answered_as_dp_sgd_over_the_rounds_of_its_groups(capsys):
    assert main(["epsilon", "--sigma", "1.0", "--sample-rate", "0.01", "--steps", "1000",
                 "--delta", "1e-5", "--sampling", "cyclic_poisson", "--sampling-groups", "4",
                 "--accountant", "rdp", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["inputs"]["sampling_groups"] == 4
    # 250 rounds of DP-SGD at the group's rate 4 q
    assert answer["results"][0]["epsilon"] == compute_epsilon([(1.0, 0.04, 250)], 1e-5, "rdp")


def test_sigma_for_cyclic_poisson_meets_the_target_of_its_rounds(capsys):
    assert main(["sigma", "--target-epsilon", "2", "--sample-rate", "0.01", "--steps", "400",
                 "--delta", "1e-5", "--sampling", "cyclic_poisson", "--sampling-groups", "4",
                 "--accountant", "rdp", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert 2 - 0.01 <= compute_epsilon([(row["noise_multiplier"], 0.04, 100)], 1e-5, "rdp") <= 2
