#!/usr/bin/env python
"""One command for a machine with one GPU: the `cuda` tests and both benchmarks, in one JSON.

Runs, each as its own part in a subprocess under its own time limit:

1. ``cuda_tests``: ``pytest -m cuda`` over the test files that mark tests ``cuda`` (the GPU
   equality tests; every one is skipped where CUDA is unavailable): passed / failed / errors /
   skipped counts and the failed tests' ids.
2. ``e2e_fp32``, ``e2e_bf16_autocast``: the paper models' end-to-end benchmark
   (``benchmark_e2e.py``: MNIST CNN, CIFAR-10 CNN, IMDb embedding and LSTM; plain PyTorch,
   dptrain hooks and ghost) in fp32 and under bf16 autocast (``hardware.precision=bf16``).
3. ``hf_fp32``, ``hf_bf16_weights``, ``hf_bf16_autocast``: the Hugging Face benchmark (the same
   script on BERT-base and GPT-2-small shapes, 12 layers, T = 128) in fp32, with bf16 weights
   (``model.dtype=bfloat16``) and under bf16 autocast.

Every figure goes into one JSON file (``--out``): the device's name, torch / CUDA / cuDNN
versions, each benchmark record's median epoch time, step time, throughput (samples/s) and peak
memory (MiB above the state before the first step; CUDA: ``max_memory_allocated``), its time
and memory multiple of plain PyTorch (``x_plain``), the bf16 / fp32 multiples of each
configuration, and the test counts. A part that fails, crashes or runs past its limit is recorded
with its status and error, and the next part runs (the whole run is bounded by ``--budget-s``,
by default the sum of the parts' limits, 420 s, + 5 s: under 8 minutes with start-up). Within a
benchmark part, each configuration has its own limit (``--timeout-s`` of benchmark_e2e.py); a
part stopped at its own limit loses its records (benchmark_e2e.py writes its JSON at the end).
Exit status 0 when every part is ``ok``, 1 otherwise; the JSON is written either way.

It installs and downloads nothing (the models are built from configs with random weights, the
data is synthetic): run it from the repository root of an environment with ``pip install -e
".[test,hf]"``, e.g. through the device tool::

    python scripts/gpu_check.py --out $OUT/gpu_check.json

On a CPU, ``--device cpu --quick`` runs every part on the smallest settings (one model and one
batch size per benchmark, a 1-layer BERT, one step): a smoke test of the script and its JSON,
not figures to publish (docs/benchmarks.md, "GPU check").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "scripts" / "benchmark_e2e.py"
TESTS = ROOT / "tests"
CUDA_MARK = "mark.cuda"
METHODS = ["plain", "dptrain_hooks", "dptrain_ghost"]
FP32 = "fp32"
#: How many times longer each part may run with --quick (on a CPU).
QUICK_SLACK = 5
#: Seconds kept back from the budget for writing the JSON after the last part.
RESERVE_S = 5.0


@dataclass
class Part:
    """One part of the check: a command run in a subprocess under ``timeout_s`` seconds."""

    name: str
    kind: str  # "tests" or "benchmark"
    timeout_s: float
    args: list[str] = field(default_factory=list)  # benchmark_e2e.py arguments
    precision: str = FP32


def benchmark_args(quick: bool, hf: bool) -> list[str]:
    """benchmark_e2e.py arguments (less --device, --precision and --out) of one benchmark."""
    if quick:
        models = ["bert_base", "--hf-layers", "1"] if hf else ["mnist_cnn"]
        return ["--models", *models, "--batch-sizes", "4", "--epochs", "1",
                "--steps-per-epoch", "1", "--threads", "1", "--timeout-s", "60",
                "--methods", "plain", "dptrain_ghost"]
    models = ["bert_base", "gpt2_small"] if hf else ["mnist_cnn", "cifar10_cnn", "imdb_embedding",
                                                    "imdb_lstm"]
    return ["--models", *models, "--batch-sizes", "32" if hf else "256", "--epochs", "3",
            "--steps-per-epoch", "5", "--timeout-s", "40", "--methods", *METHODS]


def plan(quick: bool) -> list[Part]:
    """The parts in the order they run, with their time limits in seconds: 420 in all on a GPU;
    with ``quick``, QUICK_SLACK times longer (a CPU shared with other work is slow to start the
    benchmark's processes, although each part computes for seconds only)."""
    e2e, hf = benchmark_args(quick, hf=False), benchmark_args(quick, hf=True)
    scale = QUICK_SLACK if quick else 1
    return [
        Part("cuda_tests", "tests", 90 * scale),
        Part("e2e_fp32", "benchmark", 75 * scale, e2e, FP32),
        Part("e2e_bf16_autocast", "benchmark", 75 * scale, e2e, "bf16_autocast"),
        Part("hf_fp32", "benchmark", 60 * scale, hf, FP32),
        Part("hf_bf16_weights", "benchmark", 60 * scale, hf, "bf16_weights"),
        Part("hf_bf16_autocast", "benchmark", 60 * scale, hf, "bf16_autocast"),
    ]


def cuda_test_files(tests: Path = TESTS) -> list[str]:
    """The test files that mark tests ``cuda`` (a module ``pytestmark`` or a decorator)."""
    return sorted(str(p) for p in tests.rglob("test_*.py") if CUDA_MARK in p.read_text())


def run_command(command: list[str], timeout_s: float) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, the output's tail, wall seconds) of ``command``, run in
    its own process group: on timeout the whole group (the benchmark's children too) is killed."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        code = None
    return code, (output or "")[-2000:], time.perf_counter() - start


def run_tests(part: Part, timeout_s: float, work: Path) -> dict:
    """The ``cuda`` tests: counts from pytest's JUnit XML report."""
    report = work / "cuda_tests.xml"
    files = cuda_test_files()
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *files]
    code, tail, wall = run_command(command, timeout_s)
    result = {"command": " ".join(command[1:]), "wall_s": wall, "files": files}
    if code is None:
        return {**result, "status": "timeout", "error": f"over the {timeout_s:g} s limit"}
    if not report.exists():
        return {**result, "status": "error", "error": f"pytest exit {code}, no report: {tail}"}
    counts = junit_counts(report)
    ok = code in (0, 5) and counts["failed"] == counts["errors"] == 0  # 5: nothing collected
    return {**result, **counts, "status": "ok" if ok else "failed",
            "error": None if ok else f"pytest exit {code}: {tail}"}


def junit_counts(report: Path) -> dict:
    """passed / failed / errors / skipped counts and failed test ids of a JUnit XML report."""
    root = ElementTree.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites)
             for key in ("tests", "failures", "errors", "skipped")}
    failed_ids = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                  if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"],
            "failed_tests": failed_ids}


def run_benchmark(part: Part, timeout_s: float, work: Path, device: str) -> dict:
    """One benchmark_e2e.py run at one precision: its records, each with its step time."""
    out = work / part.name
    command = [sys.executable, str(BENCHMARK), *part.args, "--device", device,
               "--precision", part.precision, "--out", str(out)]
    code, tail, wall = run_command(command, timeout_s)
    result = {"command": " ".join(command[1:]), "wall_s": wall, "precision": part.precision}
    if code is None:
        return {**result, "status": "timeout", "error": f"over the {timeout_s:g} s limit"}
    document = out / "e2e.json"
    if code != 0 or not document.exists():
        return {**result, "status": "error", "error": f"exit {code}: {tail}"}
    records = [summarized(r) for r in json.loads(document.read_text())["results"]]
    add_plain_multiples(records)
    bad = [f"{r['model']} B={r['batch_size']} {r['method']}: {r['status']} ({r['error']})"
           for r in records if r["status"] != "ok"]
    return {**result, "records": records, "status": "failed" if bad else "ok",
            "error": "; ".join(bad) or None}


def summarized(record: dict) -> dict:
    """The figures of one benchmark record: times in seconds, memory in MiB."""
    median, steps = record["median_epoch_s"], record["steps_per_epoch"]
    return {"model": record["model"], "batch_size": record["batch_size"],
            "method": record["method"], "status": record["status"], "error": record["error"],
            "epoch_times_s": record["epoch_times_s"], "median_epoch_s": median,
            "step_s": median / steps if median is not None else None,
            "samples_per_s": record["samples_per_s"], "peak_memory_mb": record["peak_memory_mb"]}


def add_plain_multiples(records: list[dict]) -> None:
    """Each record's ``time_x_plain`` and ``memory_x_plain``: its step time and peak memory over
    plain PyTorch's at the same model and batch size (None where either is missing)."""
    plain = {(r["model"], r["batch_size"]): r for r in records if r["method"] == "plain"}
    for record in records:
        reference = plain.get((record["model"], record["batch_size"]))
        record["time_x_plain"] = ratio(record, reference, "step_s")
        record["memory_x_plain"] = ratio(record, reference, "peak_memory_mb")


def ratio(record: dict, reference: dict | None, key: str) -> float | None:
    """``record[key] / reference[key]`` when both are positive finite numbers, else None."""
    if reference is None:
        return None
    a, b = record.get(key), reference.get(key)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (a, b)):
        return None
    return a / b


def precision_multiples(parts: dict[str, dict]) -> list[dict]:
    """For each configuration run in fp32 and in a 16-bit mode of the same benchmark: the 16-bit
    step time and peak memory over fp32's (< 1: faster / smaller)."""
    rows = []
    for name, part in parts.items():
        benchmark, _, precision = name.partition("_")
        if precision == FP32 or "records" not in part:
            continue
        fp32 = {key(r): r for r in parts.get(f"{benchmark}_{FP32}", {}).get("records", [])}
        for record in part["records"]:
            reference = fp32.get(key(record))
            rows.append({"benchmark": benchmark, "precision": precision, "model": record["model"],
                         "batch_size": record["batch_size"], "method": record["method"],
                         "time_x_fp32": ratio(record, reference, "step_s"),
                         "memory_x_fp32": ratio(record, reference, "peak_memory_mb")})
    return rows


def key(record: dict) -> tuple:
    """A benchmark configuration: model, batch size, method."""
    return record["model"], record["batch_size"], record["method"]


def environment(device: str) -> dict:
    """The machine and the versions the figures were measured with."""
    import torch

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    cuda = device.startswith("cuda") and torch.cuda.is_available()
    properties = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "device": device, "cuda_available": torch.cuda.is_available(),
        "device_name": properties.name if properties else platform.processor() or "cpu",
        "device_memory_gib": properties.total_memory / 2**30 if properties else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "dptrain": version("dptrain"),
        "transformers": version("transformers"), "peft": version("peft"),
    }


def run_part(part: Part, remaining_s: float, work: Path, device: str) -> dict:
    """One part under min(its limit, the budget left), never raising: an exception becomes the
    part's ``error``."""
    timeout_s = max(1.0, min(part.timeout_s, remaining_s))
    try:
        if part.kind == "tests":
            result = run_tests(part, timeout_s, work)
        else:
            result = run_benchmark(part, timeout_s, work, device)
    except Exception as error:  # noqa: BLE001 (fail soft: record it, run the next part)
        result = {"status": "error", "error": f"{type(error).__name__}: {error}"}
    return {"timeout_s": timeout_s, **result}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smallest settings: a smoke test of the script, not figures")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock limit of all parts together (each also has its own); "
                        "default: the sum of the parts' limits + 5 s (425 s without --quick)")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts_planned = plan(args.quick)
    if args.budget_s is None:
        args.budget_s = sum(part.timeout_s for part in parts_planned) + RESERVE_S
    start, started = time.perf_counter(), datetime.now(timezone.utc).isoformat()
    document: dict = {"started_utc": started, "command": " ".join(sys.argv),
                      "settings": {"device": args.device, "quick": args.quick,
                                   "budget_s": args.budget_s}}
    try:
        document["environment"] = environment(args.device)
    except Exception as error:  # noqa: BLE001
        document["environment"] = {"error": f"{type(error).__name__}: {error}"}
    parts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        for part in parts_planned:
            remaining = args.budget_s - RESERVE_S - (time.perf_counter() - start)
            if remaining < 1:
                parts[part.name] = {"status": "not_run", "error": "the --budget-s was spent"}
            else:
                parts[part.name] = run_part(part, remaining, Path(folder), args.device)
            print(f"{part.name}: {parts[part.name]['status']}"
                  + (f" ({parts[part.name]['error']})" if parts[part.name].get("error") else ""),
                  flush=True)
    document["parts"] = parts
    document["precision_multiples"] = precision_multiples(parts)
    failed = [name for name, part in parts.items() if part["status"] != "ok"]
    document["summary"] = {"parts": len(parts), "ok": len(parts) - len(failed),
                           "not_ok": failed, "wall_s": time.perf_counter() - start}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2))
    print(f"written {args.out}: {len(parts) - len(failed)} of {len(parts)} parts ok"
          + (f"; not ok: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
