"""Resident-set (CPU) memory of this process, for the benchmark scripts (Linux /proc).

A benchmark's CPU peak memory is ``peak_rss_bytes() - baseline`` where the baseline is
``current_rss_bytes()`` taken right after ``reset_peak_rss()``: the high-water mark then covers
only what ran since (not imports or model building, whose peaks would otherwise leak in).
"""

import resource
from pathlib import Path


def current_rss_bytes() -> int:
    """Resident set size of this process now, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def reset_peak_rss() -> bool:
    """Reset this process's resident-set high-water mark to the current RSS (Linux >= 4.0).

    Returns False where the kernel does not allow it; the peak then also covers earlier work, so
    a figure can only come out larger, never hide a step's peak.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """High-water mark of the resident set in bytes (``VmHWM``, else ``ru_maxrss``, KiB on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
