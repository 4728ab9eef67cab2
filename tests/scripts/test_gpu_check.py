"""scripts/gpu_check.py: its CPU smoke mode (`--device cpu --quick`) writes one JSON with every
part, and the figures in it are measurements; a part that fails or runs too long is recorded and
the next one runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
PARTS = ["cuda_tests", "e2e_fp32", "e2e_bf16_autocast", "hf_fp32", "hf_bf16_weights",
         "hf_bf16_autocast"]
SIXTEEN_BIT = ["e2e_bf16_autocast", "hf_bf16_weights", "hf_bf16_autocast"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """The one command as a user runs it, in its CPU mode."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
                             "--out", str(out)], capture_output=True, text=True, timeout=2400)
    return result, json.loads(out.read_text())


def is_measurement(value) -> bool:
    """A positive finite number."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow  # the whole smoke mode: about 90 s of two cores
def test_the_quick_mode_runs_every_part_and_exits_zero(quick_run) -> None:
    result, document = quick_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(document["parts"]) == PARTS
    assert {name: part["status"] for name, part in document["parts"].items()} == dict.fromkeys(
        PARTS, "ok")
    assert document["summary"] == {**document["summary"], "parts": 6, "ok": 6, "not_ok": []}


@pytest.mark.slow  # the whole smoke mode: about 90 s of two cores
def test_the_json_records_the_device_and_the_versions(quick_run) -> None:
    environment = quick_run[1]["environment"]
    assert environment["device"] == "cpu" and environment["device_name"]
    assert environment["torch"] and "cuda" in environment and "cudnn" in environment


@pytest.mark.slow  # the whole smoke mode: about 90 s of two cores
def test_every_benchmark_record_holds_real_step_times_throughput_and_memory(quick_run) -> None:
    for name in PARTS[1:]:
        records = quick_run[1]["parts"][name]["records"]
        assert {r["method"] for r in records} == {"plain", "dptrain_ghost"}, name
        for record in records:
            for key in ("median_epoch_s", "step_s", "samples_per_s", "peak_memory_mb",
                        "time_x_plain", "memory_x_plain"):
                assert is_measurement(record[key]), (name, key, record)
            assert record["step_s"] == record["median_epoch_s"]  # one step an epoch
            if record["method"] == "plain":
                assert record["time_x_plain"] == record["memory_x_plain"] == 1.0


@pytest.mark.slow  # the whole smoke mode: about 90 s of two cores
def test_each_16_bit_configuration_is_compared_with_its_fp32_run(quick_run) -> None:
    document = quick_run[1]
    rows = document["precision_multiples"]
    assert len(rows) == sum(len(document["parts"][name]["records"]) for name in SIXTEEN_BIT)
    assert {(r["benchmark"], r["precision"]) for r in rows} == {
        ("e2e", "bf16_autocast"), ("hf", "bf16_weights"), ("hf", "bf16_autocast")}
    for row in rows:
        assert is_measurement(row["time_x_fp32"]) and is_measurement(row["memory_x_fp32"]), row


@pytest.mark.slow  # the whole smoke mode: about 90 s of two cores
def test_the_cuda_tests_are_counted_and_skipped_without_a_gpu(quick_run) -> None:
    tests = quick_run[1]["parts"]["cuda_tests"]
    assert tests["files"] and all("test_" in f for f in tests["files"])
    assert (tests["passed"], tests["failed"], tests["errors"]) == (0, 0, 0)
    assert tests["skipped"] > 0 and is_measurement(tests["wall_s"])


def test_a_part_over_its_limit_or_failing_is_recorded_and_the_next_part_runs(
        tmp_path, monkeypatch) -> None:
    script = load_script("gpu_check")
    monkeypatch.setattr(script, "plan", lambda quick: [
        script.Part("cuda_tests", "tests", 1),
        script.Part("broken", "benchmark", 120, ["--models", "no_such_model"]),
    ])
    out = tmp_path / "check.json"
    assert script.main(["--device", "cpu", "--out", str(out)]) == 1
    parts = json.loads(out.read_text())["parts"]
    assert parts["cuda_tests"]["status"] == "timeout" and "1 s" in parts["cuda_tests"]["error"]
    assert parts["broken"]["status"] == "error" and "no_such_model" in parts["broken"]["error"]


def test_a_spent_budget_leaves_the_remaining_parts_not_run(tmp_path) -> None:
    script = load_script("gpu_check")
    out = tmp_path / "check.json"
    assert script.main(["--device", "cpu", "--budget-s", "1", "--out", str(out)]) == 1
    document = json.loads(out.read_text())
    assert {part["status"] for part in document["parts"].values()} == {"not_run"}
    assert document["summary"]["not_ok"] == PARTS
