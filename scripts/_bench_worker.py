"""Run ONE benchmark configuration in a child process and send its result to the parent.

benchmark_e2e.py starts one child per configuration from a multiprocessing *forkserver* that has
already imported torch, dptrain and Opacus (so a child starts in milliseconds, and no OpenMP or
CUDA state is inherited). A child per configuration isolates crashes, lets the parent enforce a
wall-clock limit, and makes the peak-memory figures independent of each other.

Every method runs with the same heap setting, the one dptrain's trainer uses
(:func:`dptrain.grad_sample.workspace.retain_freed_memory`: freed memory stays in the process heap
from one step to the next instead of being returned to the kernel and faulted in again), so that
the figures compare the methods' work, not glibc's trimming of what each frees per step.

Peak memory, in MiB above the state just before the first training step (model, optimizer, DP
wrapping and data pool already allocated; so it counts activations, gradients, per-sample
gradients, noise and optimizer work buffers):
- CUDA: ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before training.
- CPU: peak resident set size (the kernel's exact high-water mark, reset just before training so
  that imports and model building do not leak in; ``_bench_memory``) minus the RSS before training. A watchdog thread polls the RSS every 10 ms and ends the process with status
  ``"oom"`` when the total RSS exceeds the memory limit; a run whose ``ru_maxrss`` ended above the
  limit is also reported as ``"oom"``.
"""

import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import torch

from _bench_data import batch_pool, build_model
from _bench_memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from _bench_methods import Privacy, adapt_model, apply_precision, build_step, building_at
from dptrain.grad_sample.workspace import retain_freed_memory

MIB = 2**20


@dataclass
class Config:
    """One configuration: a model x method x batch size, and how to time it."""

    model: str
    method: str
    batch_size: int
    epochs: int
    steps: int
    device: str = "cpu"
    threads: int = 1
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    memory_limit_mb: float | None = None
    seed: int = 0
    model_kwargs: dict = field(default_factory=dict)  # e.g. {"layers": 2} for a shortened HF model
    precision: str = "fp32"  # fp32 | bf16_weights | bf16_autocast (_bench_methods.apply_precision)
    clock: str = "wall"  # wall: elapsed time; cpu: the process's CPU time (see CLOCKS)


#: Epoch clocks: ``wall`` (elapsed seconds) or ``cpu`` (seconds of CPU the process used: on a CPU
#: shared with other jobs, what a one-thread run would take on an idle core, since the time spent
#: waiting for the core is left out; CPU devices only).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Measurement:
    """What one configuration produced. ``status``: ok | oom | timeout | error | skipped."""

    status: str
    epoch_times_s: list[float] = field(default_factory=list)
    peak_memory_mb: float | None = None
    error: str | None = None


def start_rss_watchdog(
    limit_bytes: int, report: Callable[[Measurement], None], interval_s: float = 0.01
) -> None:
    """Daemon thread: ``report`` an ``"oom"`` result and exit at once when RSS > ``limit_bytes``."""

    def watch() -> None:
        while True:
            if current_rss_bytes() > limit_bytes:
                report(Measurement("oom", error=f"RSS above the {limit_bytes / MIB:.0f} MiB limit"))
                os._exit(0)
            time.sleep(interval_s)

    threading.Thread(target=watch, daemon=True).start()


class MemoryMeter:
    """Peak memory above a baseline taken at construction (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            reset_peak_rss()
            self.base = current_rss_bytes()
        self.device = device

    def peak_bytes(self) -> int:
        """Peak (absolute) bytes since the baseline: CUDA allocated or process RSS."""
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else peak_rss_bytes()

    def peak_mb(self) -> float:
        return (self.peak_bytes() - self.base) / MIB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epochs(config: Config, step, pool: list, device: torch.device) -> list[float]:
    """Seconds of each of ``config.epochs`` epochs of ``config.steps`` steps, by ``config.clock``."""
    clock = CLOCKS[config.clock]
    times = []
    for _ in range(config.epochs):
        synchronize(device)
        start = clock()
        for i in range(config.steps):
            x, y = pool[i % len(pool)]
            step(x, y)
        synchronize(device)
        times.append(clock() - start)
    return times


def measure(config: Config, report: Callable[[Measurement], None]) -> Measurement:
    """Build the model and method of ``config``, train, and measure time and peak memory.

    ``report`` is called by the memory watchdog (CPU) just before it ends the process.
    """
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    retain_freed_memory()  # every method alike (see the module docstring)
    device = torch.device(config.device)
    limit = None if config.memory_limit_mb is None else int(config.memory_limit_mb * MIB)
    if limit is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    elif limit is not None:
        start_rss_watchdog(limit, report)
    with building_at(config.precision):
        model = build_model(config.model, **config.model_kwargs)
    model = adapt_model(config.method, model).to(device)
    pool = batch_pool(config.model, config.batch_size, device, config.seed)
    model, pool = apply_precision(config.precision, model, pool)
    privacy = Privacy(config.noise_multiplier, config.max_grad_norm)
    step = build_step(config.method, model, pool, privacy)
    meter = MemoryMeter(device)
    times = time_epochs(config, step, pool, device)
    if limit is not None and device.type == "cpu" and peak_rss_bytes() > limit:
        return Measurement("oom", times, meter.peak_mb(), "peak RSS above the memory limit")
    return Measurement("ok", times, meter.peak_mb())


def child_main(config: dict, conn: Connection) -> None:
    """Entry point of the child process: measure ``Config(**config)``, send the Measurement dict."""
    def report(measurement: Measurement) -> None:
        conn.send(asdict(measurement))

    warnings.simplefilter("ignore")  # library warnings (hooks, secure RNG) would flood the table
    try:
        result = measure(Config(**config), report)
    except torch.OutOfMemoryError as exc:
        result = Measurement("oom", error=str(exc).splitlines()[0])
    except MemoryError:
        result = Measurement("oom", error="MemoryError")
    except Exception as exc:  # noqa: BLE001 - any failure is recorded, the sweep goes on
        result = Measurement("error", error=f"{type(exc).__name__}: {exc}"[:500])
    report(result)
    conn.close()
