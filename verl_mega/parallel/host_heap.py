"""glibc's heap settings for a rank that computes on the CPU.

On the CPU a step's activations, gradients and logits are host memory, allocated and freed every micro-batch.
By default glibc serves a block of 32 MiB or more (at first, of 128 KiB or more) with a `mmap` of its own and
unmaps it when it is freed, so every step faults its tensors' pages in again and the kernel zeroes each one. On
bench.vs_trl's ~100M model that was a third of the update's time, and the update reached its steady speed only
after about eight steps, as glibc raised its threshold by itself. Serving every block from the heap and keeping
what is freed there lets each step reuse the pages of the one before. The resident size then stays at the
step's high-water mark instead of falling back between steps (+3 % peak RSS on that model). PyTorch's CPU launcher
gets the same from jemalloc or tcmalloc (`torch.backends.xeon.run_cpu --enable-jemalloc`); this uses glibc's own
`mallopt`, which needs nothing installed.

A rank on a GPU keeps glibc's defaults: its tensors live in CUDA's caching allocator. A process started with
malloc settings of its own (`GLIBC_TUNABLES` naming `glibc.malloc.`, or a `MALLOC_...` variable: glibc's, or
jemalloc's `MALLOC_CONF`) keeps them. Where the C library has no `mallopt` (not glibc), nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
# Freed memory at the heap's top goes back to the system only beyond this much (mallopt takes an int).
TRIM_ABOVE = 2**31 - 1


def malloc_set_by_environment(environ=os.environ) -> bool:
    """Whether the process was started with glibc malloc settings of its own."""
    return ("glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(name.startswith("MALLOC_") for name in environ))


def keep_freed_host_memory() -> None:
    """Serve every block from glibc's heap and keep what is freed there, unless the environment set malloc
    up itself."""
    if malloc_set_by_environment():
        return
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)
