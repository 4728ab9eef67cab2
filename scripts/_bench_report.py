"""Summaries of benchmark results: per-configuration records, ratios, rich and Markdown tables.

A ratio is a time multiple: ``median epoch time of the method / median epoch time of the
reference`` at the same model and batch size (``x plain`` > 1: slower than non-private PyTorch;
``x opacus`` < 1: faster than Opacus's default hooks mode).
"""

import statistics
from dataclasses import dataclass

from rich.table import Table

from _bench_data import DATASETS, Workload

OPACUS_REFERENCE = "opacus_hooks"


@dataclass
class Record:
    """One configuration's result, as written to the JSON file.

    Times in seconds; ``full_epoch_estimate_s`` scales the median to a real epoch
    (``dataset_steps_per_epoch`` steps); memory in MiB (see _bench_worker for the definition).
    """

    model: str
    dataset: str
    method: str
    batch_size: int
    status: str
    epochs: int
    steps_per_epoch: int
    dataset_steps_per_epoch: int
    epoch_times_s: list[float]
    median_epoch_s: float | None
    first_epoch_s: float | None
    full_epoch_estimate_s: float | None
    samples_per_s: float | None
    peak_memory_mb: float | None
    error: str | None = None


def make_record(
    work: Workload, method: str, epochs: int, status: str, epoch_times_s: list[float],
    peak_memory_mb: float | None = None, error: str | None = None,
) -> Record:
    """Derive medians, the full-epoch estimate and throughput from the raw epoch times."""
    median = statistics.median(epoch_times_s) if epoch_times_s else None
    first = epoch_times_s[0] if epoch_times_s else None
    ok = status == "ok" and median is not None
    return Record(
        model=work.model, dataset=DATASETS[work.model][0], method=method,
        batch_size=work.batch_size, status=status, epochs=epochs,
        steps_per_epoch=work.steps, dataset_steps_per_epoch=work.dataset_steps,
        epoch_times_s=epoch_times_s, median_epoch_s=median, first_epoch_s=first,
        full_epoch_estimate_s=median * work.scale if ok else None,
        samples_per_s=work.batch_size * work.steps / median if ok and median > 0 else None,
        peak_memory_mb=peak_memory_mb, error=error,
    )


def ratio(records: list[dict], record: dict, reference: str, key: str = "median_epoch_s") -> float | None:
    """``record``'s median epoch time (or another ``key``: ``peak_memory_mb``) over that of
    method ``reference`` (same model and batch)."""
    for other in records:
        same = other["model"] == record["model"] and other["batch_size"] == record["batch_size"]
        if same and other["method"] == reference:
            if record[key] and other[key] and other["status"] == "ok":
                return record[key] / other[key]
    return None


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _row(records: list[dict], r: dict) -> list[str]:
    """Cells: model, batch, method, status, median/first epoch, samples/s, memory, ratios."""
    return [
        r["model"], str(r["batch_size"]), r["method"], r["status"],
        _fmt(r["median_epoch_s"], "{:.3f}"), _fmt(r["first_epoch_s"], "{:.3f}"),
        _fmt(r["samples_per_s"], "{:,.0f}"), _fmt(r["peak_memory_mb"], "{:,.0f}"),
        _fmt(ratio(records, r, "plain"), "{:.2f}"),
        _fmt(ratio(records, r, OPACUS_REFERENCE), "{:.2f}"),
    ]


HEADERS = ["model", "B", "method", "status", "median epoch s", "first epoch s", "samples/s",
           "peak MiB", "x plain", "x opacus"]


def rich_table(records: list[dict], title: str) -> Table:
    """All configurations, one row each (timings of the shortened epochs)."""
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header, justify="left" if header in ("model", "method", "status") else "right")
    for r in records:
        table.add_row(*_row(records, r))
    return table


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def markdown_table(records: list[dict]) -> str:
    """The ratio summary, then every configuration, in GitHub Markdown (for docs/benchmarks.md)."""
    return (_markdown(SUMMARY_HEADERS, summary_rows(records)) + "\n"
            + _markdown(HEADERS, [_row(records, r) for r in records]) + "\n"
            + overhead_markdown(records))


def fastest_private(records: list[dict], model: str, batch_size: int) -> str:
    """The fastest DP method (every method but ``plain``) that ran at ``model``/``batch_size``."""
    done = [r for r in records if r["model"] == model and r["batch_size"] == batch_size
            and r["status"] == "ok" and r["method"] != "plain"]
    return min(done, key=lambda r: r["median_epoch_s"])["method"] if done else "-"


#: (column header, method, reference method) of the ratio summary.
SUMMARY_RATIOS = [
    ("hooks / plain", "dptrain_hooks", "plain"),
    ("ghost / plain", "dptrain_ghost", "plain"),
    ("hooks / opacus hooks", "dptrain_hooks", "opacus_hooks"),
    ("ghost / opacus ghost", "dptrain_ghost", "opacus_ghost"),
    ("ghost / opacus hooks", "dptrain_ghost", "opacus_hooks"),
]
#: (column header, method, reference) of the peak-memory multiples in the summary.
MEMORY_RATIOS = [("ghost mem / plain", "dptrain_ghost", "plain")]
SUMMARY_HEADERS = ["model", "B", *(h for h, _, _ in SUMMARY_RATIOS + MEMORY_RATIOS), "fastest DP method"]


def summary_rows(records: list[dict]) -> list[list[str]]:
    """Per model and batch size: dptrain's time multiples of PyTorch and Opacus, ghost mode's
    peak-memory multiple of PyTorch, fastest DP method."""
    rows = []
    keys = dict.fromkeys((r["model"], r["batch_size"]) for r in records)
    for model, batch_size in keys:
        by_method = {r["method"]: r for r in records
                     if r["model"] == model and r["batch_size"] == batch_size}
        cells = [_fmt(ratio(records, by_method[m], ref, key) if m in by_method else None, "{:.2f}")
                 for ratios, key in ((SUMMARY_RATIOS, "median_epoch_s"), (MEMORY_RATIOS, "peak_memory_mb"))
                 for _, m, ref in ratios]
        rows.append([model, str(batch_size), *cells, fastest_private(records, model, batch_size)])
    return rows


def summary_table(records: list[dict], title: str) -> Table:
    """The ratio summary as a rich table."""
    table = Table(title=title)
    for header in SUMMARY_HEADERS:
        table.add_column(header, justify="left" if header in ("model", "fastest DP method") else "right")
    for row in summary_rows(records):
        table.add_row(*row)
    return table


#: Methods whose per-step time the overhead table compares with plain PyTorch's.
OVERHEAD_METHODS = ("dptrain_hooks", "dptrain_ghost", "opacus_hooks", "opacus_ghost")
OVERHEAD_HEADERS = ["model", "B", "plain ms/step",
                    *(f"{m} ms/step (+ over plain)" for m in OVERHEAD_METHODS)]


def step_ms(record: dict) -> float | None:
    """A record's median epoch time per step, in milliseconds (None when it did not finish)."""
    if record["status"] != "ok" or not record["median_epoch_s"]:
        return None
    return 1e3 * record["median_epoch_s"] / record["steps_per_epoch"]


def overhead_rows(records: list[dict]) -> list[list[str]]:
    """Per model and batch size: plain PyTorch's ms per step, and each DP method's with its excess
    over plain (the per-step overhead: on a one-layer model, nearly all of the DP step)."""
    rows = []
    for model, batch_size in dict.fromkeys((r["model"], r["batch_size"]) for r in records):
        ms = {r["method"]: step_ms(r) for r in records
              if r["model"] == model and r["batch_size"] == batch_size}
        plain = ms.get("plain")
        cells = [_fmt(ms.get(m), "{:.2f}") + ("" if ms.get(m) is None or plain is None
                                               else f" (+{ms[m] - plain:.2f})")
                 for m in OVERHEAD_METHODS]
        rows.append([model, str(batch_size), _fmt(plain, "{:.2f}"), *cells])
    return rows


def overhead_markdown(records: list[dict]) -> str:
    """The per-step overhead table in GitHub Markdown."""
    return _markdown(OVERHEAD_HEADERS, overhead_rows(records))
