#!/usr/bin/env python
"""End-to-end DP-SGD training speed, reproducing the Opacus paper's Figure 2.

For each model (default: the paper's MNIST CNN, CIFAR-10 CNN, IMDb embedding and IMDb LSTM
networks, ``dptrain.models``) x batch size x method, trains on synthetic data of the real
dataset's shapes and records the per-epoch runtime (median and first epoch), throughput and
peak memory. Methods: ``plain`` PyTorch (no DP), ``microbatch`` (naive DP-SGD: one
forward/backward per sample), ``dptrain_hooks`` and ``dptrain_ghost`` (dptrain.make_private),
``opacus_hooks`` and ``opacus_ghost`` (when Opacus is installed). All DP methods use the same
sigma and C, SGD, and fixed batches of exactly B samples (instead of Poisson sampling: the
timing is that of a batch of the expected size). Each configuration runs in its own child
process (forked from a server that preloaded torch, dptrain and Opacus) under a wall-clock and a
memory limit; one that exceeds them is recorded as ``timeout``/``oom`` (and larger batch sizes of
the same model and method are not attempted).

Outputs in ``--out``: ``e2e.json`` (environment, settings, one record per configuration),
``e2e.md`` (the table), ``e2e_runtime.png`` (Figure 2 style) and ``e2e_cumulative.png``
(Figure 4 style; both need matplotlib); a figure that cannot be drawn (no matplotlib, nothing
finished at its batch size) is skipped and named, with the reason, in the output and in
``e2e.json`` (``skipped_figures``); the table is printed.

Example (the CPU run of docs/benchmarks.md)::

    python scripts/benchmark_e2e.py --batch-sizes 64 256 1024 --epochs 3 --steps-per-epoch 5

The per-step overhead (docs/benchmarks.md, "Per-step overhead"): ``one_layer`` is one
``nn.Linear(10, 2)``, whose DP step is nearly all fixed cost; ``--rounds`` runs every
configuration several times in turn and takes the median over all rounds; the last table printed
(and ``e2e.md``) gives each method's milliseconds per step and its excess over plain PyTorch::

    python scripts/benchmark_e2e.py --models one_layer mnist_cnn cifar10_cnn imdb_embedding \
        imdb_lstm --batch-sizes 64 256 --methods plain dptrain_hooks dptrain_ghost opacus_hooks \
        --epochs 3 --steps-per-epoch 40 --threads 1 --rounds 3 --clock cpu

(``--clock cpu``: each epoch's CPU seconds rather than its elapsed time, which on a machine shared
with other jobs mostly measures the others.)

Hugging Face models (``bert_base``, ``gpt2_small`` and their ``*_lora`` variants, ``_bench_hf``;
``pip install "dptrain[hf]"``): ``--hf-layers`` shortens their 12-layer stacks for a CPU run, and
the layer rules and each layer's ghost/instantiate choice are printed and saved as
``layer_choices`` in ``e2e.json``::

    python scripts/benchmark_e2e.py --models bert_base bert_base_lora gpt2_small gpt2_small_lora \
        --batch-sizes 8 --methods plain dptrain_hooks dptrain_ghost opacus_hooks opacus_ghost \
        --epochs 2 --steps-per-epoch 2 --hf-layers 2

``--precision bf16_weights`` (weights in bfloat16, as ``model.dtype=bfloat16``) or
``--precision bf16_autocast`` (fp32 weights under bf16 autocast, as ``hardware.precision=bf16``)
trains every configuration at that precision; run once per precision (``--out`` apart) to
compare with fp32 (docs/transformers.md, "16-bit training: time and memory (CPU)")::

    python scripts/benchmark_e2e.py --models bert_base gpt2_small --batch-sizes 8 \
        --methods plain dptrain_hooks dptrain_ghost --epochs 2 --steps-per-epoch 2 \
        --hf-layers 2 --precision bf16_weights --out benchmark_results/bf16_weights
"""

import argparse
import functools
import json
import multiprocessing
import multiprocessing.context
import os
import platform
import signal
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from _bench_data import DATASETS, Workload, workload  # noqa: E402
from _bench_hf import HF_MODELS, layer_choices  # noqa: E402
from _bench_methods import METHODS, PRECISIONS, unavailable_reason  # noqa: E402
from _bench_plots import (  # noqa: E402
    MATPLOTLIB_MISSING, cumulative_figure, default_cumulative_batch, finished_records,
    matplotlib_available, runtime_figure,
)
from _bench_report import (  # noqa: E402
    make_record, markdown_table, overhead_rows, rich_table, summary_table, OVERHEAD_HEADERS,
)
from _bench_worker import CLOCKS, Config, child_main  # noqa: E402

PAPER_MODELS = ["mnist_cnn", "cifar10_cnn", "imdb_embedding", "imdb_lstm"]
FAILED = ("oom", "timeout")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=PAPER_MODELS, choices=sorted(DATASETS),
                   help="models to run (transformer: the 6x512 GPT, T=256, vocab 32k)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64, 256, 1024],
                   help="batch sizes (the paper: 16 32 64 128 256 512 1024 2048)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epochs", type=int, default=3, help="epochs per configuration (paper: 20)")
    p.add_argument("--steps-per-epoch", type=int, default=5,
                   help="steps timed per epoch; 0 = a real epoch, ceil(dataset size / B)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every configuration, in turn (each in its own process); a "
                        "record's median is over the epochs of all its rounds")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="epoch times in elapsed seconds (wall) or in the process's CPU seconds "
                        "(cpu: on a machine shared with other jobs, a one-thread run's time on an "
                        "idle core; CPU only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch intra-op threads per configuration")
    p.add_argument("--noise-multiplier", type=float, default=1.0, help="sigma of every DP method")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping norm C")
    p.add_argument("--memory-limit-mb", type=float, default=None,
                   help="per-configuration memory limit (CPU: total RSS; CUDA: allocator cap); "
                        "default: 80%% of physical RAM on CPU, the whole device on CUDA")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="wall-clock limit per configuration (including start-up)")
    p.add_argument("--cumulative-batch-size", type=int, default=None,
                   help="batch size of the cumulative-runtime figure (default: closest to 256)")
    p.add_argument("--hf-layers", type=int, default=12,
                   help="transformer blocks of the Hugging Face models (BERT-base, GPT-2 small: 12)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="bf16_weights: weights (and float inputs) in bfloat16, as model.dtype="
                        "bfloat16; bf16_autocast: fp32 weights under bf16 autocast, as "
                        "hardware.precision=bf16")
    p.add_argument("--out", type=Path, default=Path("benchmark_results"), help="output folder")
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or min(args.epochs, args.rounds) < 1 or args.steps_per_epoch < 0:
        p.error("--batch-sizes, --epochs and --rounds must be >= 1, --steps-per-epoch >= 0")
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu times the process's CPU work: use it with --device cpu")
    if args.memory_limit_mb is None and args.device == "cpu":
        args.memory_limit_mb = 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    return args


def environment(args: argparse.Namespace) -> dict:
    """Versions, device and threads: what a reader needs to compare numbers across machines."""
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    device = torch.device(args.device)
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "processor": _cpu_name(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "torch": torch.__version__, "dptrain": version("dptrain"), "opacus": version("opacus"),
        "transformers": version("transformers"), "peft": version("peft"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor()


#: Modules the forkserver imports once, so that each configuration's child starts at once
#: (torch._dynamo: imported lazily by the first torch.optim optimizer, seconds).
PRELOAD = ["__main__", "torch", "torch._dynamo", "_bench_worker", "_bench_methods",
           "dptrain.models", "dptrain.privacy.engine", "dptrain.grad_sample.ghost", "opacus"]
#: Added to PRELOAD when a Hugging Face model is run (seconds to import: not for other runs).
HF_PRELOAD = ["transformers", "peft"]


@functools.cache
def _forkserver() -> multiprocessing.context.BaseContext:
    """The multiprocessing context that starts configuration children (see _bench_worker)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # missing optional modules are skipped
    return context


def run_config(config: Config, timeout_s: float) -> tuple[str, list[float], float | None, str | None]:
    """Run one configuration in a child process: (status, epoch times, peak MiB, error).

    The child is killed when it exceeds ``timeout_s`` and whenever this function is left early
    (Ctrl-C, SIGTERM), so no orphan keeps computing.
    """
    context = _forkserver()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=child_main, args=(asdict(config), sender), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            return "timeout", [], None, f"over the {timeout_s:g} s limit"
        result = receiver.recv()
    except EOFError:  # died without reporting: killed (e.g. by the kernel's OOM killer) or crashed
        child.join()
        killed = child.exitcode is not None and child.exitcode < 0
        return ("oom" if killed else "error"), [], None, f"child exit code {child.exitcode}"
    finally:
        if child.is_alive():  # timed out, interrupted, or still exiting after its report
            child.kill()
        child.join()
        receiver.close()
    return result["status"], result["epoch_times_s"], result["peak_memory_mb"], result["error"]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM -> SystemExit, so that run_config's cleanup kills the running child."""
    raise SystemExit(128 + signum)


def sweep(args: argparse.Namespace, console: Console) -> list[dict]:
    """Every model x batch size x method, smallest batch first, ``args.rounds`` times in turn
    (round r of every configuration before round r + 1: a change of the machine's load falls on
    all methods alike); returns the JSON records, each with the epoch times of all rounds."""
    failed_at: dict[tuple[str, str], str] = {}
    runs: dict[tuple[str, int, str], list] = {}
    for round_ in range(args.rounds):
        for model in args.models:
            for batch_size in sorted(args.batch_sizes):
                work = workload(model, batch_size, args.steps_per_epoch or None)
                for method in args.methods:
                    record = _run_one(args, work, method, failed_at)
                    runs.setdefault((model, batch_size, method), []).append(record)
                    console.print(f"{model:15} B={batch_size:<5} {method:14} {record.status:8} "
                                  f"median {record.median_epoch_s or float('nan'):.3f} s"
                                  + (f"  round {round_ + 1}/{args.rounds}" if args.rounds > 1 else "")
                                  + (f"  ({record.error})" if record.error else ""))
    return [asdict(_pooled(rounds)) for rounds in runs.values()]


def _pooled(rounds: list):
    """One record from a configuration's rounds: the epoch times of the rounds that ran (the
    median is taken over all of them), or the last round's record when none ran."""
    done = [r for r in rounds if r.status == "ok"]
    if len(rounds) == 1 or not done:
        return rounds[-1]
    first = done[0]
    work = Workload(first.model, first.batch_size, first.dataset_steps_per_epoch, first.steps_per_epoch)
    times = [t for r in done for t in r.epoch_times_s]
    return make_record(work, first.method, first.epochs * len(done), "ok", times,
                       max(r.peak_memory_mb or 0.0 for r in done) or None)


def _run_one(args: argparse.Namespace, work: Workload, method: str, failed_at: dict):
    """One configuration, or a skipped/failed record without running it when that is known."""
    reason = unavailable_reason(method)
    if reason:
        return make_record(work, method, args.epochs, "skipped", [], error=reason)
    earlier = failed_at.get((work.model, method))
    if earlier:
        return make_record(work, method, args.epochs, earlier, [],
                           error=f"not run: {earlier} at a smaller batch size")
    config = Config(
        model=work.model, method=method, batch_size=work.batch_size, epochs=args.epochs,
        steps=work.steps, device=args.device, threads=args.threads,
        noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
        memory_limit_mb=args.memory_limit_mb,
        model_kwargs={"layers": args.hf_layers} if work.model in HF_MODELS else {},
        precision=args.precision, clock=args.clock,
    )
    status, times, memory, error = run_config(config, args.timeout_s)
    if status in FAILED:
        failed_at[(work.model, method)] = status
    return make_record(work, method, args.epochs, status, times, memory, error)


def hf_layer_choices(args: argparse.Namespace, console: Console) -> dict:
    """For each Hugging Face model run: its layer rules and ghost/instantiate choices (printed)."""
    choices = {}
    for model in (m for m in args.models if m in HF_MODELS):
        choices[model] = layer_choices(model, args.hf_layers)
        console.print(f"{model} ({args.hf_layers} layers): layer rules\n{choices[model]['rules']}")
        console.print(f"  torch.func fallbacks: {choices[model]['fallbacks']}")
        console.print(f"  ghost mode choices at T=128: {choices[model]['choices']}")
    return choices


RUNTIME_FIGURE, CUMULATIVE_FIGURE = "e2e_runtime.png", "e2e_cumulative.png"


def skipped_figures(args: argparse.Namespace, records: list[dict]) -> dict[str, str]:
    """{figure file: why it is not drawn} for the figures this run cannot draw."""
    if not matplotlib_available():
        return {RUNTIME_FIGURE: MATPLOTLIB_MISSING, CUMULATIVE_FIGURE: MATPLOTLIB_MISSING}
    done = finished_records(records)
    if not done:
        reason = "no configuration finished (every one was skipped, failed or out of limits)"
        return {RUNTIME_FIGURE: reason, CUMULATIVE_FIGURE: reason}
    batch = args.cumulative_batch_size or default_cumulative_batch(args.batch_sizes)
    if not any(r["batch_size"] == batch for r in done):
        return {CUMULATIVE_FIGURE: f"no configuration finished at batch size {batch} "
                                   "(--cumulative-batch-size)"}
    return {}


def write_outputs(args: argparse.Namespace, records: list[dict], console: Console,
                  choices: dict | None = None) -> dict:
    """JSON, Markdown table and figures into ``args.out``; returns the JSON document, whose
    ``written`` lists the files written and ``skipped_figures`` each figure not drawn and why
    (both also printed)."""
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["sampling"] = "fixed batches of B samples (timing stand-in for Poisson sampling)"
    skipped = skipped_figures(args, records)
    document = {"environment": environment(args), "settings": settings, "results": records,
                "notes": [f"{name} skipped: {why}" for name, why in skipped.items()],
                "written": ["e2e.json", "e2e.md"], "skipped_figures": skipped}
    if choices:
        document["layer_choices"] = choices
    (args.out / "e2e.md").write_text(markdown_table(records))
    if RUNTIME_FIGURE not in skipped:
        runtime_figure(records, args.models, args.methods, args.out / RUNTIME_FIGURE)
        document["written"].append(RUNTIME_FIGURE)
    if CUMULATIVE_FIGURE not in skipped:
        batch = args.cumulative_batch_size or default_cumulative_batch(args.batch_sizes)
        cumulative_figure(records, args.models, args.methods, batch, args.out / CUMULATIVE_FIGURE)
        document["written"].append(CUMULATIVE_FIGURE)
    for note in document["notes"]:
        console.print(note)
    (args.out / "e2e.json").write_text(json.dumps(document, indent=2))
    return document


def overhead_table(records: list[dict]) -> Table:
    """Milliseconds per step of each method, and its excess over plain PyTorch's."""
    table = Table(title="Per-step time, ms (in parentheses: the excess over plain PyTorch)")
    for header in OVERHEAD_HEADERS:
        table.add_column(header, justify="left" if header == "model" else "right")
    for row in overhead_rows(records):
        table.add_row(*row)
    return table


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for the whole table
        console = Console(width=170)
    if any(m in HF_MODELS for m in args.models):
        PRELOAD.extend(m for m in HF_PRELOAD if m not in PRELOAD)  # before the forkserver starts
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        records = sweep(args, console)
    finally:
        signal.signal(signal.SIGTERM, previous)
    document = write_outputs(args, records, console, hf_layer_choices(args, console))
    label = (f"{args.device}, {args.precision}, {args.threads} threads, {args.clock} clock, "
             f"{args.steps_per_epoch or 'full'} steps/epoch")
    console.print(rich_table(records, f"End-to-end DP-SGD epoch time ({label})"))
    console.print(summary_table(records, "Time multiples (< 1: dptrain faster)"))
    console.print(overhead_table(records))
    skipped = document["skipped_figures"]
    console.print(f"written to {args.out}/ ({', '.join(document['written'])})"
                  + (f"; skipped: {', '.join(skipped)} (see above)" if skipped else ""))


if __name__ == "__main__":
    main()
