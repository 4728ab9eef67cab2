"""Per-step CPU time of several methods and code versions, measured in turns (an A/B on a shared machine).

On a machine that other jobs load, a configuration timed in its own process at its own moment
(benchmark_e2e.py) meets another load than the next one: two runs of the same code differ by
20-40 % there, more than a change of a few hundred microseconds a step. Here every arm (a method
of benchmark_e2e.py, run with one code version of dptrain) is a child process that builds its
step once and then runs ``--steps`` steps each time it is asked; the parent asks the arms in
turn, ``--rounds`` times (the order reversed every other round), so that every arm meets the same
load, and reports each arm's median CPU milliseconds per step (``time.process_time`` of the child,
one torch thread), its excess over plain PyTorch and its quartiles.

    PYTHONPATH=$PWD python scripts/bench_interleaved.py --model one_layer --batch-size 64 \\
        --steps 200 --rounds 40 --versions main=/path/to/old/checkout new=$PWD

Arms: ``plain`` and the Opacus methods once (with the last version on the path), each dptrain
method once per version. Fixed batches of B samples, as in benchmark_e2e.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("plain", "dptrain_hooks", "dptrain_ghost", "opacus_hooks", "opacus_ghost")


def child(model: str, method: str, batch_size: int) -> None:
    """Build one arm's step, say "ready", then for each line N of stdin run N steps and print
    their CPU milliseconds per step."""
    sys.path.insert(0, str(HERE))
    warnings.simplefilter("ignore")
    import torch

    from _bench_data import batch_pool, build_model
    from _bench_methods import Privacy, adapt_model, build_step
    from dptrain.grad_sample.workspace import retain_freed_memory

    torch.set_num_threads(1)
    retain_freed_memory()  # as benchmark_e2e.py's workers
    torch.manual_seed(0)
    pool = batch_pool(model, batch_size, torch.device("cpu"))
    step = build_step(method, adapt_model(method, build_model(model)), pool, Privacy())
    for i in range(10):  # warm-up: first-call costs (allocations, lazy imports) left out
        step(*pool[i % len(pool)])
    print("ready", flush=True)
    done = 0
    for line in sys.stdin:
        steps = int(line)
        start = time.process_time()
        for _ in range(steps):
            step(*pool[done % len(pool)])
            done += 1
        print((time.process_time() - start) / steps * 1e3, flush=True)


def arms(methods: list[str], versions: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """``(label, method, dptrain checkout)`` of every arm: dptrain methods once per version."""
    out = []
    for method in methods:
        if method.startswith("dptrain"):
            out += [(f"{method} ({name})", method, path) for name, path in versions]
        else:
            out.append((method, method, versions[-1][1]))
    return out


def run(model: str, batch_size: int, steps: int, rounds: int, methods: list[str],
        versions: list[tuple[str, str]]) -> dict:
    """Every arm's CPU ms per step over ``rounds`` turns of ``steps`` steps: {label: [ms, ...]}."""
    procs = []
    for label, method, path in arms(methods, versions):
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        command = [sys.executable, str(Path(__file__).resolve()), "--child", model, method, str(batch_size)]
        procs.append((label, subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              text=True, env=env, cwd=HERE)))
    try:
        for label, proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"arm {label!r} failed to start (see its stderr above)")
        times: dict[str, list[float]] = {label: [] for label, _ in procs}
        for turn in range(rounds):
            for label, proc in procs if turn % 2 == 0 else procs[::-1]:
                proc.stdin.write(f"{steps}\n")
                proc.stdin.flush()
                times[label].append(float(proc.stdout.readline()))
    finally:
        for _, proc in procs:
            proc.stdin.close()
            proc.wait()
    return times


def summary(times: dict[str, list[float]]) -> list[dict]:
    """Per arm: median ms per step, its excess over plain and ratio to it, quartiles."""
    plain = statistics.median(times["plain"]) if "plain" in times else None
    rows = []
    for label, values in times.items():
        median = statistics.median(values)
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (median, median, median)
        rows.append({"arm": label, "median_ms": median, "q1_ms": q1, "q3_ms": q3,
                     "over_plain_ms": None if plain is None else median - plain,
                     "x_plain": None if plain is None else median / plain})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| arm | CPU ms/step (median) | + over plain | x plain | quartiles |", "|---|---|---|---|---|"]
    for r in rows:
        over = "-" if r["over_plain_ms"] is None else f"{r['over_plain_ms']:+.3f}"
        ratio = "-" if r["x_plain"] is None else f"{r['x_plain']:.2f}"
        lines.append(f"| {r['arm']} | {r['median_ms']:.3f} | {over} | {ratio} | "
                     f"{r['q1_ms']:.3f}-{r['q3_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="one_layer")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="steps per arm and turn")
    parser.add_argument("--rounds", type=int, default=30, help="turns of every arm")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--versions", nargs="+", default=[f"current={HERE.parent}"],
                        help="NAME=PATH: a dptrain checkout for the dptrain methods (each gets one arm)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the per-turn times")
    args = parser.parse_args(argv)
    versions = [tuple(v.split("=", 1)) for v in args.versions]
    load = os.getloadavg()[0]
    times = run(args.model, args.batch_size, args.steps, args.rounds, args.methods, versions)
    rows = summary(times)
    print(f"{args.model} B={args.batch_size}: {args.rounds} turns of {args.steps} steps per arm; "
          f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print(markdown(rows))
    document = {"settings": {**vars(args), "out": str(args.out), "versions": dict(versions)},
                "load_average": [load, os.getloadavg()[0]], "times_ms": times, "summary": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    return document


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
