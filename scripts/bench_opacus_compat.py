#!/usr/bin/env python
"""Step time of one Opacus-style script under Opacus and under dptrain.opacus, in one run.

The script is Opacus's MNIST example as a migrating user has it: its model (SampleConvNet, read
from the vendored copy tests/compat/opacus_examples/mnist.py), SGD, PrivacyEngine().make_private
with Poisson sampling, and the example's loop (zero_grad, forward, CrossEntropyLoss, backward,
step), on synthetic MNIST-shaped tensors (N images of 1x28x28, 10 classes). The only difference
between the two runs is the package PrivacyEngine comes from. The runs alternate (opacus,
dptrain.opacus, opacus, ...) so that load from other processes falls on both; each run reports
the mean time per step of `--steps` steps after `--warmup` steps, and the median over
`--repeats` runs is printed with the ratio dptrain.opacus / opacus (below 1: dptrain faster).

    python scripts/bench_opacus_compat.py --threads 1 --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EXAMPLE = Path(__file__).resolve().parent.parent / "tests" / "compat" / "opacus_examples" / "mnist.py"
PACKAGES = ("opacus", "dptrain.opacus")


def step_time(package: str, model_class: type[nn.Module], data: TensorDataset, batch_size: int,
              warmup: int, steps: int) -> float:
    """Mean seconds per step of the MNIST example's loop, PrivacyEngine from `package`."""
    engine = importlib.import_module(package).PrivacyEngine()
    model = model_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0)
    loader = DataLoader(data, batch_size=batch_size, num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0)
    criterion = nn.CrossEntropyLoss()
    model.train()
    done, start = 0, 0.0
    while done < warmup + steps:
        for x, y in loader:
            if done == warmup:
                start = time.perf_counter()
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == warmup + steps:
                break
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="expected (Poisson) batch size")
    parser.add_argument("--samples", type=int, default=6400, help="synthetic training images")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # both engines warn about their randomness on every run
    model_class = runpy.run_path(str(EXAMPLE))["SampleConvNet"]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 1, 28, 28, generator=generator),
                         torch.randint(0, 10, (args.samples,), generator=generator))
    times: dict[str, list[float]] = {p: [] for p in PACKAGES}
    for _ in range(args.repeats):
        for package in PACKAGES:
            times[package].append(step_time(package, model_class, data, args.batch_size,
                                            args.warmup, args.steps))
    median = {p: statistics.median(t) for p, t in times.items()}
    print(f"MNIST example CNN, expected batch {args.batch_size}, {args.steps} steps x "
          f"{args.repeats} runs, torch {torch.__version__}, {args.threads} thread(s)")
    for package in PACKAGES:
        runs = ", ".join(f"{1e3 * t:.1f}" for t in times[package])
        print(f"  {package:15s} median {1e3 * median[package]:7.1f} ms/step  (runs: {runs})")
    print(f"  ratio dptrain.opacus / opacus: {median['dptrain.opacus'] / median['opacus']:.2f}")


if __name__ == "__main__":
    main()
