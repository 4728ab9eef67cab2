"""Per-layer micro-benchmark of the per-sample gradient engine (like the Opacus paper, Section 3.2).

For every supported layer alone: forward+backward time and peak memory of the plain torch layer
versus the same layer wrapped in ``dptrain.GradSampleModule`` (for the DP layers, "plain" is the
fused torch layer: ``nn.LSTM`` vs the wrapped ``DPLSTM``). Printed as a rich table with ratios.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over one forward+backward minus what was
allocated before it. On CPU, each measurement runs in a forked process and reports the growth of
the process's peak resident set (``VmHWM``, reset to the current RSS just before the step) over one
forward+backward: it includes allocator overhead and is only meaningful above a few MB, so sizes default to a scale where it is.

    python scripts/benchmark_layers.py                    # all layers, CPU, batch 32
    python scripts/benchmark_layers.py --layers Linear Conv2d --repeats 20 --device cuda
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402

import dptrain  # noqa: E402
from dptrain.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One layer to benchmark: builders of the plain and the private layer, and of its input."""

    name: str
    plain: Callable[[], nn.Module]
    private: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    shape: str
    opacus_layer: str = ""  # for DP layers: the opacus.layers class name; else the plain layer


def _same(make: Callable[[], nn.Module]) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module]]:
    return make, make


def _bags(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EmbeddingBag input in its flat form: 32 ids per bag, ``(ids [32B], offsets [B])``."""
    return torch.randint(0, 2000, (batch * 32,)), torch.arange(0, batch * 32, 32)


def _dp_layers() -> list[Case]:
    """Cases for the DP layers (plain = the fused torch layer)."""
    seq = lambda b: (torch.randn(b, 16, 64),)  # noqa: E731
    qkv = lambda b: (torch.randn(b, 16, 64),) * 3  # noqa: E731
    return [
        Case("LSTM", lambda: nn.LSTM(64, 64, batch_first=True), lambda: DPLSTM(64, 64, batch_first=True), seq, "[B,16,64]", "DPLSTM"),
        Case("GRU", lambda: nn.GRU(64, 64, batch_first=True), lambda: DPGRU(64, 64, batch_first=True), seq, "[B,16,64]", "DPGRU"),
        Case("RNN", lambda: nn.RNN(64, 64, batch_first=True), lambda: DPRNN(64, 64, batch_first=True), seq, "[B,16,64]", "DPRNN"),
        Case(
            "MultiheadAttention",
            lambda: nn.MultiheadAttention(64, 4, batch_first=True),
            lambda: DPMultiheadAttention(64, 4, batch_first=True),
            qkv,
            "[B,16,64]x3",
            "DPMultiheadAttention",
        ),
    ]


def cases() -> list[Case]:
    """Every benchmarked layer with a small, representative size."""
    tokens = lambda b: (torch.randint(0, 2000, (b, 32)),)  # noqa: E731
    return [
        Case("Linear", *_same(lambda: nn.Linear(512, 512)), lambda b: (torch.randn(b, 512),), "[B,512]"),
        Case("Linear3d", *_same(lambda: nn.Linear(256, 256)), lambda b: (torch.randn(b, 16, 256),), "[B,16,256]"),
        Case("Conv1d", *_same(lambda: nn.Conv1d(16, 32, 3, padding=1)), lambda b: (torch.randn(b, 16, 128),), "[B,16,128]"),
        Case("Conv2d", *_same(lambda: nn.Conv2d(16, 32, 3, padding=1)), lambda b: (torch.randn(b, 16, 32, 32),), "[B,16,32,32]"),
        Case("Conv3d", *_same(lambda: nn.Conv3d(4, 8, 3, padding=1)), lambda b: (torch.randn(b, 4, 12, 12, 12),), "[B,4,12,12,12]"),
        Case("Embedding", *_same(lambda: nn.Embedding(2000, 64)), tokens, "[B,32] of 2000x64"),
        Case("EmbeddingBag", *_same(lambda: nn.EmbeddingBag(2000, 64, mode="mean")), _bags, "[32B]+offsets of 2000x64"),
        Case("LayerNorm", *_same(lambda: nn.LayerNorm(256)), lambda b: (torch.randn(b, 16, 256),), "[B,16,256]"),
        Case("GroupNorm", *_same(lambda: nn.GroupNorm(8, 32)), lambda b: (torch.randn(b, 32, 16, 16),), "[B,32,16,16]"),
        Case(
            "InstanceNorm2d",
            *_same(lambda: nn.InstanceNorm2d(32, affine=True)),
            lambda b: (torch.randn(b, 32, 16, 16),),
            "[B,32,16,16]",
        ),
        Case("RMSNorm", *_same(lambda: nn.RMSNorm(256)), lambda b: (torch.randn(b, 16, 256),), "[B,16,256]"),
        *_dp_layers(),
    ]


def _first_tensor(output: object) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _step(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """One forward+backward (loss = sum of squares of the first output), then free grad samples."""
    _first_tensor(model(*inputs)).pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad_sample = None


def _opacus_model(case: Case) -> nn.Module:
    """The same layer in Opacus's GradSampleModule (its DP layer for LSTM/GRU/RNN/attention)."""
    import opacus
    import opacus.layers

    if case.opacus_layer:
        plain = case.plain()
        layer = getattr(opacus.layers, case.opacus_layer)(*_constructor_args(plain), batch_first=True)
    else:
        layer = case.plain()
    return opacus.GradSampleModule(layer)


def _constructor_args(plain: nn.Module) -> tuple[int, ...]:
    """Positional constructor arguments of the benchmarked torch RNN / attention layer."""
    if isinstance(plain, nn.MultiheadAttention):
        return plain.embed_dim, plain.num_heads
    return plain.input_size, plain.hidden_size


def _build(case: Case, mode: str, batch: int, device: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model under test and its inputs; ``mode`` is "plain" (torch layer), "wrapped"
    (dptrain.GradSampleModule around the private layer) or "opacus"."""
    torch.manual_seed(0)
    if mode == "opacus":
        model = _opacus_model(case)
    elif mode == "wrapped":
        model = dptrain.GradSampleModule(case.private())
    else:
        model = case.plain()
    return model.to(device), tuple(t.to(device) for t in case.inputs(batch))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_memory_mb(model: nn.Module, inputs: tuple[torch.Tensor, ...], device: str) -> float:
    """Peak extra memory (MB) of one forward+backward; see the module docstring for the method."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, inputs)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    reset_peak_rss()
    before = current_rss_bytes()
    _step(model, inputs)
    return (peak_rss_bytes() - before) / 2**20


def median_ms(model: nn.Module, inputs: tuple[torch.Tensor, ...], device: str, repeats: int) -> float:
    """Median wall time (ms) of ``repeats`` forward+backward steps, after one warm-up step."""
    _step(model, inputs)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        _step(model, inputs)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(case: Case, mode: str, batch: int, device: str, repeats: int) -> dict[str, float]:
    """Memory first (on a fresh process/peak counter), then time."""
    model, inputs = _build(case, mode, batch, device)
    memory = peak_memory_mb(model, inputs, device)
    return {"ms": median_ms(model, inputs, device, repeats), "mb": memory}


FAILED = {"ms": float("nan"), "mb": float("nan")}


def measure_or_report(case: Case, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """:func:`measure`, or NaN figures (and the reason on stderr) if this cell cannot run."""
    try:
        return measure(case, mode, args.batch_size, args.device, args.repeats)
    except Exception as err:  # one failing cell (e.g. a layer Opacus does not support) is not fatal
        print(f"{case.name} / {mode}: {type(err).__name__}: {err}", file=sys.stderr)
        return FAILED


def _worker(case: Case, mode: str, args: argparse.Namespace, queue: multiprocessing.Queue) -> None:
    queue.put(measure_or_report(case, mode, args))


def measure_in_subprocess(case: Case, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Run :func:`measure` in a forked process so that its peak-RSS growth is this case's alone."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(case, mode, args, queue))
    process.start()
    process.join()
    return queue.get() if process.exitcode == 0 else FAILED


def run_all(args: argparse.Namespace) -> list[dict]:
    """Measure every selected case, plain and wrapped."""
    rows = []
    for case in cases():
        if args.layers and case.name not in args.layers:
            continue
        result = {"layer": case.name, "input": case.shape}
        for mode in ("plain", "wrapped", "opacus") if args.opacus else ("plain", "wrapped"):
            if args.device == "cpu":
                figures = measure_in_subprocess(case, mode, args)
            else:
                figures = measure_or_report(case, mode, args)
            result.update({f"{mode}_ms": figures["ms"], f"{mode}_mb": figures["mb"]})
        rows.append(result)
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    """Rich table with time and memory ratios (wrapped / plain)."""
    from rich.console import Console
    from rich.table import Table

    method = (
        "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS growth (VmHWM after a reset), one forked process per cell"
    )
    table = Table(
        title=f"Per-sample gradients per layer: batch {args.batch_size}, {args.device}, {args.threads} thread(s), "
        f"median of {args.repeats} fwd+bwd",
        caption=f"peak memory: {method}; plain = torch layer (fused nn.LSTM/GRU/RNN/MultiheadAttention for DP layers); "
        f"time x / memory x = wrapped / plain",
    )
    columns = ["layer", "input", "plain ms", "wrapped ms", "time x", "plain MB", "wrapped MB", "memory x"]
    if args.opacus:
        columns += ["opacus ms", "opacus MB"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("layer", "input") else "right")
    for r in rows:
        mem_ratio = r["wrapped_mb"] / r["plain_mb"] if r["plain_mb"] > 0.5 else float("nan")
        cells = [
            r["layer"], r["input"], f"{r['plain_ms']:.2f}", f"{r['wrapped_ms']:.2f}",
            f"{r['wrapped_ms'] / r['plain_ms']:.1f}", f"{r['plain_mb']:.1f}", f"{r['wrapped_mb']:.1f}", f"{mem_ratio:.1f}",
        ]
        if args.opacus:
            cells += [f"{r['opacus_ms']:.2f}", f"{r['opacus_mb']:.1f}"]
        table.add_row(*cells)
    Console(width=150).print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per cell (median reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--layers", nargs="*", help="subset of layer names (default: all)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--opacus", action="store_true", help="add Opacus's GradSampleModule as a reference column")
    args = parser.parse_args(argv)
    known = [case.name for case in cases()]
    unknown = sorted(set(args.layers or []) - set(known))
    if unknown:
        parser.error(f"--layers: unknown layer(s) {unknown}; choose among {known}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Opacus's module hooks warn on every step when the layer's input does not require grad.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rows = run_all(args)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
