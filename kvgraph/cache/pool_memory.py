"""Memory for a CPU cache pool: zeroed, and on Linux advised for transparent huge pages.

A decode step reads every sequence's pages, scattered over a pool of gigabytes; in 4 KB pages
each page of the cache costs the reads a TLB miss, and on a virtual machine a two-level page walk.
The pool is therefore aligned to 2 MB and advised ``MADV_HUGEPAGE`` before it is first touched, so
that where transparent huge pages are on ``madvise`` (a common default) the kernel backs it with
2 MB pages. On a 2-core Zen 3 VM the decode attention over such a pool took 0.93-0.97x the time
(``benchmarks/RESULTS.md``). Zeroing costs more at start-up in huge pages: 1.0-2.0 s for a 2 GB pool
here against 0.8-0.9 s. (A pool left to the kernel's zero pages, faulted in as sequences first use
it, measured no faster than 4 KB pages end to end, so the pool is zeroed up front.)
``KVGRAPH_HUGE_PAGES=0`` (read at each allocation) turns it off, as it does for the packed weights
(``kvgraph/ops/csrc/pack_arena.cpp``).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def enabled() -> bool:
    """Whether pools are advised for huge pages (``KVGRAPH_HUGE_PAGES`` other than ``0``)."""
    return os.environ.get("KVGRAPH_HUGE_PAGES", "1") != "0"


def _madvise(address: int, length: int) -> bool:
    """``madvise(address, length, MADV_HUGEPAGE)``; False where it failed or libc has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's, no ldconfig run
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; for a pool of 2 MB or more on a Linux CPU,
    a view that starts on a 2 MB boundary of memory advised for huge pages before it was zeroed."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not touched yet
    offset = -raw.data_ptr() % HUGE_PAGE
    _madvise(raw.data_ptr() + offset, nbytes // HUGE_PAGE * HUGE_PAGE)  # advice: without THP, 4 KB pages
    pool = raw[offset : offset + nbytes].view(dtype).view(shape)
    pool.zero_()
    return pool
