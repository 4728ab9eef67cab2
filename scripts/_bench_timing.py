"""Wall-clock timing shared by the micro-benchmark scripts."""

import statistics
import time
from typing import Any, Callable


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
