"""Intra-op threads that follow the cores other processes leave free.

An OpenMP parallel region ends when its slowest thread does. When another process takes one of
the cores, the thread that shares it runs in time slices, and every region of every layer waits
for it: on a 2-core host one busy neighbour makes a 2-thread ``F.linear`` at decode shapes 2-4x
slower than the same call on 1 thread (``benchmarks/contention.py``). The governor samples, at most
every ``interval_s`` between steps, how much CPU time the other processes took on the cores this
process may run on (``/proc/stat`` per core, minus this process's own time), and picks the
cores left, between 1 and the thread count the engine started with. The engine runs each step's
graphs and sampling on that many threads (``kvgraph.bind``'s ``threads``), set only once Dynamo's
guards have passed: Dynamo guards on the process's thread count, which stays as it was, so a new
count re-traces nothing. Nothing else changes: the same kernels run, on fewer threads while the
cores are shared. Inductor's kernels take the thread count at run time
(``kvgraph.compiler.backend`` compiles them with ``cpp.dynamic_threads``), so every kernel of a
step follows it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

BUSY_FRACTION = 0.25  # a core counts as taken when others used more than this share of it


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds at one moment: ``busy`` on the watched cores (all processes), ``own`` of this process."""

    wall: float
    busy: float
    own: float


def read_sample(cores: frozenset[int]) -> CpuSample | None:
    """Busy seconds of ``cores`` from ``/proc/stat``, this process's CPU seconds, and the time;
    ``None`` where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        values = [int(v) for v in fields]
        busy += sum(values[:8]) - values[3] - values[4]  # all but idle and iowait (guest is in user)
    times = os.times()
    return CpuSample(time.monotonic(), busy / tick, times.user + times.system)


class ThreadGovernor:
    """Picks the intra-op thread count of each step: the cores the other processes leave free.

    Args:
        max_threads: the most threads to use (the count the engine started with).
        interval_s: the least time between two decisions; shorter samples are too coarse
            (``/proc/stat`` counts in ticks of 10 ms).
    """

    def __init__(self, max_threads: int, interval_s: float = 0.5) -> None:
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.threads = max_threads
        self.others = 0.0  # cores the other processes took over the last interval
        self.changes = 0
        self._last = read_sample(self.cores)

    def update(self) -> int:
        """Re-decide the thread count if ``interval_s`` has passed since the last decision; returns it."""
        if self._last is None or self.max_threads <= 1:
            return self.threads
        now = time.monotonic()
        if now - self._last.wall < self.interval_s:
            return self.threads
        sample = read_sample(self.cores)
        if sample is None:
            return self.threads
        elapsed = sample.wall - self._last.wall
        own = sample.own - self._last.own
        self.others = max(0.0, (sample.busy - self._last.busy - own) / elapsed)
        self._last = sample
        free = len(self.cores) - math.ceil(self.others - BUSY_FRACTION)
        threads = max(1, min(self.max_threads, free))
        if threads != self.threads:
            self.changes += 1
        self.threads = threads
        return self.threads
