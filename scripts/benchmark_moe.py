"""Time and memory of private training of a mixture-of-experts model on CPU, against non-private.

A random-init Mixtral causal LM from a transformers config (router and fused experts trained, the
default ``grouped_mm`` experts kernel, float32) trains on random token batches with each method of
``_bench_methods`` (``plain``: non-private SGD; ``dptrain_hooks``; ``dptrain_ghost``), one fresh
process per method, one after the other. Reported per method: the median seconds per step over
``--steps`` steps after one warm-up step, and the peak resident memory over all the steps above the
state just before the first (model, optimizer and wrapping excluded; activations, gradients,
per-sample work and noise included: ``_bench_memory``), plus the ghost module's choice for the
routers and the experts.

    python scripts/benchmark_moe.py --out moe.json     # the figures of docs/transformers.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

METHODS = ("plain", "dptrain_hooks", "dptrain_ghost")


@dataclass(frozen=True)
class Shape:
    """The model and batch: Mixtral with ``layers`` layers of width ``hidden``, ``experts`` experts
    of width ``inner``, top-``top_k`` routing; batches of ``batch`` sequences of ``seq`` tokens."""

    hidden: int = 256
    inner: int = 512
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    heads: int = 4
    vocab: int = 2000
    seq: int = 64
    batch: int = 8


def build_model(shape: Shape):
    """The Mixtral causal LM of ``shape`` (seeded), wrapped to map ids ``[B, T]`` to logits."""
    import torch
    import transformers
    from torch import nn

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inner,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        num_local_experts=shape.experts, num_experts_per_tok=shape.top_k, max_position_embeddings=shape.seq)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.MixtralForCausalLM(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    return Logits().train()


def worker(method: str, shape: Shape, steps: int) -> dict:
    """One method's figures (run in a fresh process)."""
    import torch
    from _bench_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from _bench_methods import Privacy, build_step

    from dptrain.grad_sample.workspace import retain_freed_memory

    retain_freed_memory()
    model = build_model(shape)
    generator = torch.Generator().manual_seed(1)
    pool = [(torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=generator),) * 2
            for _ in range(steps + 1)]
    step = build_step(method, model, pool, Privacy())
    reset_peak_rss()  # before the first step: its activations and gradients count
    baseline = current_rss_bytes()
    step(*pool[0])  # warm-up (also sets the ghost module's choices), not timed
    times = []
    for x, y in pool[1:]:
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    record = {"method": method, "median_step_s": statistics.median(times), "step_times_s": times,
              "peak_memory_mib": (peak_rss_bytes() - baseline) / 2**20}
    private = _private_model(step)
    if private is not None:  # ghost mode: what it chose for the routers and experts
        chosen = private.layer_strategies()
        record["moe_strategies"] = {kind: sorted({v for k, v in chosen.items() if k.endswith(f".{layer}")})
                                    for kind, layer in (("routers", "gate"), ("experts", "experts"))}
    return record


def _private_model(step):
    """The private model a ``_bench_methods`` step closes over (for its ghost choices), else None."""
    for cell in step.__closure__ or ():
        if hasattr(cell.cell_contents, "layer_strategies"):
            return cell.cell_contents
    return None


def run_method(method: str, shape: Shape, steps: int, threads: int) -> dict:
    """Run ``method`` in a fresh Python process; its record."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", method, "--shape", json.dumps(asdict(shape)),
               "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"method": method, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(records: list[dict]) -> str:
    """A text table: seconds per step and peak MiB, each with its multiple of plain's."""
    plain = next((r for r in records if r["method"] == "plain" and "error" not in r), None)
    lines = ["method          s/step  (x plain)   peak MiB  (x plain)"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['method']:<15} error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        t, m = r["median_step_s"], r["peak_memory_mib"]
        xt = f"{t / plain['median_step_s']:.2f}" if plain else "-"
        xm = f"{m / plain['peak_memory_mib']:.2f}" if plain and plain["peak_memory_mib"] > 0 else "-"
        lines.append(f"{r['method']:<15} {t:7.3f}  ({xt:>5})  {m:9.1f}  ({xm:>5})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", default=None, help="a JSON object of Shape fields to change")
    parser.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = Shape(**json.loads(args.shape)) if args.shape else Shape()
    if args.worker:
        print(json.dumps(worker(args.worker, shape, args.steps)))
        return {}
    records = [run_method(m, shape, args.steps, args.threads) for m in args.methods]
    document = {"shape": asdict(shape), "threads": args.threads, "steps": args.steps, "results": records}
    print(f"Mixtral {asdict(shape)}, {args.threads} thread(s), median of {args.steps} steps")
    print(table(records))
    if args.out is not None:
        args.out.write_text(json.dumps(document, indent=2))
    return document


if __name__ == "__main__":
    main()
