#!/usr/bin/env python
"""Step time and memory of correlated noise (banded, BLT) against independent noise.

For each model (the paper models and a BERT-shaped transformer), one DP-SGD step (zero_grad,
forward, backward, per-sample clipping, noise, SGD step) is timed with each noise strategy on the
same weights and batch: independent (DP-SGD), banded with ``--bands`` bands and BLT with
``--buffers`` buffers (both optimised for ``--horizon`` steps). The strategies' steps are
interleaved round-robin after a warm-up of ``--warmup`` steps (which also fills the buffers),
and the median of ``--steps`` steps of each is kept. As whole-step times on a busy machine vary by
several percent, the noise of one step is also timed alone (`noise_only_ms`: every parameter's
draw through the generator), and its extra time over independent noise is reported as a share of
an independent-noise step ("added %"). Memory: the noise generator's buffers
(bytes held between steps, and their ratio to the trainable parameters' bytes), and on CUDA the
peak allocated memory of each strategy's steps (``torch.cuda.max_memory_allocated``, reset
before each).

The engine refuses correlated noise until its accounting exists, so the benchmark builds the
DP optimizer directly (the mechanism is the same).

Examples::

    python scripts/bench_noise.py --size small --steps 10
    python scripts/bench_noise.py --size paper --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dptrain.grad_sample.module import GradSampleModule  # noqa: E402
from dptrain.models import get_model, input_spec  # noqa: E402
from dptrain.privacy.noise import Banded, Blt, Independent  # noqa: E402
from dptrain.privacy.optimizer import DPOptimizer  # noqa: E402

PAPER_MODELS = ["mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm"]
# "bert": the transformer at BERT-base's shape (paper size) or a small one of the same layout
BERT_SHAPES = {
    "paper": {"vocab_size": 30_522, "seq_len": 128, "n_layer": 12, "n_embd": 768, "n_head": 12},
    "small": {"vocab_size": 4_000, "seq_len": 64, "n_layer": 2, "n_embd": 256, "n_head": 4},
}
BATCH = {"paper": 64, "small": 16}


def build(name: str, size: str, batch: int, device: str) -> tuple[nn.Module, Any, Any]:
    """The model and one random batch (x, y) on `device` (same weights for every call)."""
    torch.manual_seed(0)
    model_name, kwargs = ("transformer", BERT_SHAPES[size]) if name == "bert" else (name, {})
    x, y = input_spec(model_name, **kwargs).batch(batch)
    return get_model(model_name, **kwargs).to(device), x.to(device), y.to(device)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (and tokens for language models)."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def strategies(bands: int, buffers: int, horizon: int) -> dict[str, Any]:
    """The strategies compared, optimised for `horizon` steps."""
    return {"independent": Independent(), f"banded{bands}": Banded.optimised(bands, horizon),
            f"blt{buffers}": Blt.optimised(buffers, horizon)}


def private_step(name: str, size: str, batch: int, device: str, strategy: Any):
    """(step function, optimizer) of one DP-SGD step with `strategy` on model `name`."""
    model, x, y = build(name, size, batch, device)
    source = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), 1.0, 1.0, batch,
                            module=source, sample_rate=0.01, noise_strategy=strategy)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(source(x), y).backward()
        optimizer.step()

    return step, optimizer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(name: str, size: str, batch: int, device: str, chosen: dict[str, Any],
            warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """{strategy: {"step_ms", "buffer_bytes", "param_bytes", "peak_bytes"}} for model `name`."""
    runs = {key: private_step(name, size, batch, device, s) for key, s in chosen.items()}
    times: dict[str, list[float]] = {key: [] for key in runs}
    peaks: dict[str, int] = {key: 0 for key in runs}
    for round_ in range(warmup + steps):
        for key, (step, _) in runs.items():
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            if round_ >= warmup:
                times[key].append(time.perf_counter() - start)
                if device.startswith("cuda"):
                    peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated())
    noise_ms = {key: noise_only_ms(optimizer, warmup, steps)
                for key, (_, optimizer) in runs.items()}
    out = {}
    for key, (_, optimizer) in runs.items():
        held = optimizer.noise_generator_state.buffers
        out[key] = {"step_ms": 1e3 * statistics.median(times[key]),
                    "buffer_bytes": sum(b.numel() * b.element_size()
                                        for bufs in held.values() for b in bufs),
                    "param_bytes": sum(p.numel() * p.element_size() for p in optimizer.params),
                    "peak_bytes": peaks[key], "noise_ms": noise_ms[key]}
    return out


def noise_only_ms(optimizer: DPOptimizer, warmup: int, steps: int) -> float:
    """Median ms of the noise of one step alone (every parameter's draw through the strategy's
    generator, a copy of the optimizer's so its state is left alone): the part of the step a
    strategy changes, less disturbed by a busy machine than whole steps."""
    generator = optimizer.noise_strategy.generator()
    params = optimizer.params
    device = params[0].device.type if params else "cpu"
    times = []
    for round_ in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        for key, p in enumerate(params):
            generator(key, optimizer._noise_draw(p, 1.0))
        _sync(device)
        if round_ >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=PAPER_MODELS + ["bert"])
    parser.add_argument("--size", choices=sorted(BERT_SHAPES), default="small",
                        help="the BERT-shaped model's size and the batch size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--buffers", type=int, default=3)
    parser.add_argument("--horizon", type=int, default=1000, help="steps optimised for")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    chosen = strategies(args.bands, args.buffers, args.horizon)
    results = {}
    print(f"device {args.device}, batch {BATCH[args.size]}, median of {args.steps} steps")
    print(f"{'model':16} {'strategy':12} {'step ms':>9} {'x indep':>8} {'noise ms':>9} "
          f"{'added %':>8} {'buffers MB':>11} {'x params':>9} {'peak MB':>9}")
    for name in args.models:
        figures = measure(name, args.size, BATCH[args.size], args.device, chosen,
                          args.warmup, args.steps)
        base = figures["independent"]
        for key, f in figures.items():
            f["time_ratio"] = f["step_ms"] / base["step_ms"]
            # the noise's extra time as a share of an independent-noise step
            f["added_pct"] = 100 * (f["noise_ms"] - base["noise_ms"]) / base["step_ms"]
            print(f"{name:16} {key:12} {f['step_ms']:9.2f} {f['time_ratio']:8.3f} "
                  f"{f['noise_ms']:9.2f} {f['added_pct']:8.2f} "
                  f"{f['buffer_bytes'] / 2**20:11.2f} {f['buffer_bytes'] / f['param_bytes']:9.2f} "
                  f"{f['peak_bytes'] / 2**20:9.1f}")
        results[name] = figures
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
