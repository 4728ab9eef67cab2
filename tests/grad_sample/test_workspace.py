"""retain_freed_memory: the heap keeps freed per-step tensors for the next step (glibc)."""

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter (the setting is process-wide): the bytes glibc maps outside its heap for
# a live 16 MiB tensor (mallinfo2().hblkhd while it lives, minus before; mapped blocks are returned
# to the kernel when freed, heap memory is kept).
_PROBE = """
import ctypes, ctypes.util, sys, torch
from dptrain.grad_sample.workspace import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
t = torch.empty(4 * 2**20)
print(libc.mallinfo2().hblkhd - before)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _mapped_bytes_of_a_16_mib_tensor(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


@glibc_only
def test_a_16_mib_tensor_comes_from_the_heap_which_keeps_it_when_freed():
    assert _mapped_bytes_of_a_16_mib_tensor("retain") == 0


@glibc_only
def test_by_default_a_16_mib_tensor_is_mapped_on_its_own_and_unmapped_when_freed():
    # the premise of the setting (glibc's adaptive threshold starts at 128 KiB)
    assert _mapped_bytes_of_a_16_mib_tensor("default") >= 16 * 2**20
