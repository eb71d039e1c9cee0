"""Memory for a CPU cache pool: zeroed, and on Linux advised for transparent huge pages.

A decode step reads every sequence's pages, scattered over a pool of gigabytes; in 4 KB pages
each page of the cache costs the reads a TLB miss, and on a virtual machine a two-level page walk.
The pool is therefore aligned to 2 MB and advised ``MADV_HUGEPAGE`` before it is first touched, so
that where transparent huge pages are on ``madvise`` (a common default) the kernel backs it with
2 MB pages. On a 2-core Zen 3 VM the decode attention over such a pool took 0.93-0.97x the time
(``benchmarks/RESULTS.md``).

The pool is a fresh anonymous mapping, whose pages the kernel zeroes as it first maps them, so it is
never written from here. By default (``KVGRAPH_POOL_POPULATE=lazy``) its pages are left to be
mapped where a step first writes them: a start does not pay for the whole pool, a run pays for the
pages it uses, and the pool takes memory only as it is used. Mapping is the dear part on a virtual
machine: mapping a 2 GB pool up front took 2.5-4 CPU-seconds of kernel time on a 2-core Zen 3 VM,
1.2-2.2 s of a start; left to first writes, those pages cost a fresh engine's first run of
``llama-56m`` a few percent (lazy / eager time, medians of ten alternating pairs: ``mixed`` 0.94,
``decode-heavy`` 1.06; ``benchmarks/pool_populate.py``), and later runs nothing once the pages
they reuse are mapped (mapping a 2 MB page cost 2.3-3.6x what 512 4 KB pages did there).
``eager`` maps the whole pool before it is returned, by ``madvise(MADV_POPULATE_WRITE)`` (Linux
5.14) split over the intra-op threads (the call releases the GIL), so that no step ever takes a
fault (a kernel that refuses it has the pool written with zeros instead).
``KVGRAPH_HUGE_PAGES=0`` (read at each allocation) turns it off, as it does for the packed weights
(``kvgraph/ops/csrc/pack_arena.cpp``).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading

import torch

from kvgraph.errors import ConfigError

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without writing them
POPULATE_SPLIT = 64 << 20  # bytes a populating thread takes at least
POPULATE_MODES = ("lazy", "eager")


def enabled() -> bool:
    """Whether pools are advised for huge pages (``KVGRAPH_HUGE_PAGES`` other than ``0``)."""
    return os.environ.get("KVGRAPH_HUGE_PAGES", "1") != "0"


def populate_mode() -> str:
    """How a new pool's pages get mapped (``KVGRAPH_POOL_POPULATE``, read at each allocation): one of
    ``POPULATE_MODES``; a ``ConfigError`` naming any other value."""
    mode = os.environ.get("KVGRAPH_POOL_POPULATE", "lazy")
    if mode not in POPULATE_MODES:
        raise ConfigError(f"KVGRAPH_POOL_POPULATE={mode!r}; expected one of {', '.join(POPULATE_MODES)}")
    return mode


def available_bytes() -> int | None:
    """Linux's estimate of the memory a new allocation can take without swapping (``MemAvailable``
    of ``/proc/meminfo``), in bytes; ``None`` where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(nbytes: int) -> None:
    """A ``ConfigError`` naming both sizes if a CPU pool of ``nbytes`` is more than the memory
    available. With its pages mapped as steps first write them (the default), a pool that cannot fit
    would otherwise end the process once it fills (the prefix cache's reuse order reaches every page
    in time); mapped up front, at the start, without saying why."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise ConfigError(
            f"the KV cache pool needs {nbytes} bytes, more than the {available} bytes of memory available "
            f"(MemAvailable); lower kv_cache_memory (or max_batch_size * max_seq_len)"
        )


def _madvise(address: int, length: int, advice: int = MADV_HUGEPAGE) -> bool:
    """``madvise(address, length, advice)``; False where it failed or libc has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols: libc's, no ldconfig run
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def _populate(address: int, length: int) -> bool:
    """Maps ``[address, address + length)`` (page aligned) writable, in slices on up to
    ``torch.get_num_threads()`` threads; False where the kernel refused any slice."""
    parts = max(1, min(torch.get_num_threads(), length // POPULATE_SPLIT))
    step = -(-length // parts // HUGE_PAGE) * HUGE_PAGE
    spans = [(a, min(step, length - a)) for a in range(0, length, step)]
    done = [False] * len(spans)

    def run(i: int) -> None:
        done[i] = _madvise(address + spans[i][0], spans[i][1], MADV_POPULATE_WRITE)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(spans))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    return all(done)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; for a pool of 2 MB or more on a Linux CPU,
    a view that starts on a 2 MB boundary of a fresh anonymous mapping advised for huge pages before
    its pages were mapped, mapped as ``populate_mode()`` says."""
    mode = populate_mode()  # a bad value is refused whichever memory this pool gets
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping; unmapped with the tensor
    offset = -raw.data_ptr() % HUGE_PAGE
    start = raw.data_ptr() + offset
    _madvise(start, nbytes // HUGE_PAGE * HUGE_PAGE)  # advice: without THP, 4 KB pages
    pool = raw[offset : offset + nbytes].view(dtype).view(shape)
    if mode == "eager" and not _populate(start, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE):
        pool.zero_()  # a kernel before Linux 5.14: faulted in by writing it
    return pool
