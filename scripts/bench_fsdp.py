"""Per-rank peak memory and step time of FSDP against DDP, private against non-private, on CPU.

    python scripts/bench_fsdp.py                                # GPT-2 small shape, 1, 2 and 4 ranks
    python scripts/bench_fsdp.py --layers 2 --width 256 --vocab 8192 --ranks 1 2 --out fsdp.json

Each configuration starts `ranks` forked processes (gloo, one thread each) that build the same
GPT-2-shaped causal LM (Hugging Face's GPT2LMHeadModel from a config: tied embedding and head),
wrap it in DistributedDataParallel or shard it with fully_shard (one unit per GPT2Block, then the
root), and train `--steps` steps with AdamW on random token ids: plainly (each rank a batch of
batch/ranks sequences), or privately with dptrain (ghost clipping, Poisson batches of expected
size `--batch` over all ranks, sigma 1). Per rank it reports:

* `held_mb`: the parameters and optimizer state this rank holds between steps (its local shards
  under FSDP, everything under DDP), from the tensors themselves;
* `peak_rss_mb`: the process's resident-set high-water mark over the timed steps minus its
  resident set before them (Linux /proc; CPU memory, including gathered parameters, activations,
  per-sample work and communication buffers);
* `step_s`: the median time of the timed steps (after `--warmup` steps).

CPU timings on a shared machine vary from run to run; compare figures from one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402

MB = 2**20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1))


def _loss(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token loss, averaged over the batch (0 on an empty batch)."""
    logits = module(input_ids=ids).logits[:, :-1]
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(dim=1).sum() / max(len(ids), 1)


def _held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and optimizer state this rank holds (local shards of DTensors)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, kind: str,
            private: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1800))
    try:
        result = _train(rank, world, args, kind, private)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def _train(rank: int, world: int, args: argparse.Namespace, kind: str, private: bool) -> dict[str, Any]:
    model = _model(args)
    if kind == "fsdp":
        from dptrain.distributed.fsdp import shard_model

        shard_model(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = args.warmup + args.steps
    ids = torch.randint(0, args.vocab, (args.batch * steps, args.seq),
                        generator=torch.Generator().manual_seed(0))
    if private:
        from dptrain.privacy.engine import PrivacyEngine

        engine = PrivacyEngine(accountant="rdp")
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids),
                                                                      batch_size=args.batch),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
        batches = ((x,) for (x,) in loader)
    else:
        module = model
        shard = ids[rank::world]
        per_rank = max(1, args.batch // world)
        batches = ((shard[i * per_rank:(i + 1) * per_rank],) for i in range(steps))
    times, held, peak = [], 0, 0
    for step, (x,) in enumerate(batches):
        if step == steps:
            break
        if step == args.warmup:
            held = _held_bytes(model, getattr(optimizer, "original_optimizer", optimizer))
            reset_peak_rss()
            base = current_rss_bytes()
        start = time.perf_counter()
        optimizer.zero_grad()
        if len(x) or (kind == "fsdp" and world > 1):  # FSDP's ranks run every pass, empty too
            _loss(module, x).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = peak_rss_bytes() - base
    return {"held_mb": held / MB, "peak_rss_mb": peak / MB, "step_s": statistics.median(times)}


def run(args: argparse.Namespace, ranks: int, kind: str, private: bool, folder: Path) -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_worker, args=(ranks, _free_port(), args, kind, private,
                                                str(folder)),
                                 nprocs=ranks, join=False, start_method="fork")
    while not context.join():
        pass
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global (expected) batch size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path("bench_fsdp.json"))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for kind in ("ddp", "fsdp"):
                for private in (False, True):
                    per_rank = run(args, ranks, kind, private, Path(tmp) / f"{kind}{ranks}{private}")
                    row = {"ranks": ranks, "kind": kind, "private": private,
                           "held_mb": max(r["held_mb"] for r in per_rank),
                           "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                           "step_s": max(r["step_s"] for r in per_rank)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
