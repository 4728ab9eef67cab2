"""How much working memory one per-sample computation may take at once.

A per-sample kernel (a grouped convolution over the batch, an unfolded input, a batch of Gram
matrices) can need several times the memory of the tensors it reads: on CPU, mkldnn's grouped
weight-gradient kernel took 13x its output for the paper CIFAR-10 CNN's 32x32 convolutions (122
MiB at B = 256). Run inside the backward pass or next to the kept activations and gradients, that
working memory is what sets the peak. So such computations run over chunks of samples, each
chunk's estimated working memory at most the layer's own inputs and output gradients (what plain
training holds for the layer anyway), and never below :data:`MIN_WORKSPACE` elements (small
layers and batches run in one call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

#: Elements a per-sample computation may always use at once (16 MiB of float32).
MIN_WORKSPACE = 2**22


def sample_chunks(batch: int, per_sample: int, budget: int) -> list[slice]:
    """Row slices covering ``range(batch)`` whose working memory fits the budget.

    Args:
        batch: B.
        per_sample: estimated working memory of one sample, in elements.
        budget: elements the whole computation may use (at least :data:`MIN_WORKSPACE`).

    Returns:
        ``[slice(0, b), slice(b, 2b), ...]`` with ``b = max(1, budget // per_sample)`` (one slice
        when everything fits, ``[slice(0, 0)]`` for ``B = 0``).
    """
    size = max(1, max(budget, MIN_WORKSPACE) // max(per_sample, 1))
    return [slice(start, min(start + size, batch)) for start in range(0, max(batch, 1), size)]


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations below this size come from the heap (glibc's own ceiling for its adaptive threshold
#: on 64-bit, ``DEFAULT_MMAP_THRESHOLD_MAX``): larger ones are mapped and unmapped per tensor.
HEAP_MMAP_THRESHOLD = 32 * 2**20
#: Free memory the heap keeps at its top instead of returning it to the kernel.
HEAP_TRIM_THRESHOLD = 128 * 2**20


def retain_freed_memory(
    mmap_threshold: int = HEAP_MMAP_THRESHOLD, trim_threshold: int = HEAP_TRIM_THRESHOLD
) -> bool:
    """Let the process heap keep the memory freed at the end of one training step for the next.

    A DP step allocates and frees megabytes of per-sample tensors (per-sample gradients, the
    working buffers of their kernels) that plain training does not. With glibc's adaptive
    defaults, the heap returns the freed top to the kernel after the step (``M_TRIM_THRESHOLD``,
    twice the adaptive mmap threshold), and the next step's allocations fault the same pages in
    again, zero-filled: on CPU this cost mnist_cnn about 2,000 page faults (2-3 ms) per ghost step at
    B = 64. Fixing the thresholds (allocations up to ``mmap_threshold`` bytes from the heap, up to
    ``trim_threshold`` bytes of free heap kept) makes a steady training loop fault nothing.

    The setting is process-wide and only decides when freed memory goes back to the kernel (the
    process's resident memory after a step may stay up to ``trim_threshold`` above what it uses;
    the peak is unchanged): no data survives in a form any tensor can read. It applies to glibc
    (Linux) only; elsewhere nothing is changed.

    Returns:
        True when the thresholds were set, False when the C library has no ``mallopt`` (not glibc).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
