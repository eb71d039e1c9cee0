"""The HTTP front end's CPU priority against the engine process's kernel threads.

On a host with no core to spare, the front end's work (parsing requests, tokenizing, writing
chunks) lands on a core that one of the engine's kernel threads holds. An OpenMP region ends with
its slowest thread, so every layer of the step then waits while the front end runs. At the
``idle`` priority (Linux's ``SCHED_IDLE``) the front end runs when a core has nothing else to do:
between the engine's kernels and steps, while its own threads' work waits a little. The engine
process keeps the normal priority (it was started before the change, and a thread's scheduling
policy is per thread).

``auto`` (the default) is ``idle`` where the engine's kernel threads take every core the process
may run on and Linux has ``SCHED_IDLE``, else ``normal``. Measured on a 2-core host at 32 streams
(``benchmarks/RESULTS.md``): ``llama-56m`` served 1.07-1.17x the tokens/s of a normal-priority
front end, for inter-token latencies of 0.08-0.14 s at p99 instead of 0.03; ``/health`` answered
in 9-12 ms (p50, at most 0.3 s) during a long prefill-heavy load instead of 1 ms.
"""

from __future__ import annotations

import os

from kvgraph.errors import ConfigError

PRIORITIES = ("auto", "normal", "idle")


def check(priority: str, frontend_process: bool) -> None:
    """``ConfigError`` for a priority this host or these settings cannot have, before anything starts."""
    if priority not in PRIORITIES:
        raise ConfigError(f"frontend priority {priority!r} is not one of {', '.join(PRIORITIES)}")
    if priority in ("auto", "normal"):
        return
    if not frontend_process:
        raise ConfigError(f"--frontend-priority {priority} needs the engine in its own process; "
                          "with --no-frontend-process the engine would run at that priority too")
    if not hasattr(os, "SCHED_IDLE"):
        raise ConfigError(f"--frontend-priority {priority} needs Linux's SCHED_IDLE, which this "
                          "platform does not have")


def resolve(priority: str, engine_threads: int, cores: int) -> str:
    """``normal`` or ``idle``: what ``priority`` (checked by :func:`check`) means for a front end in
    its own process beside an engine of ``engine_threads`` kernel threads (all its ranks') on
    ``cores`` cores."""
    if priority != "auto":
        return priority
    idle = hasattr(os, "SCHED_IDLE") and engine_threads >= cores
    return "idle" if idle else "normal"


def apply(priority: str) -> list[int]:
    """Put every thread of this process at ``priority`` (``normal`` or ``idle``: see :func:`resolve`);
    threads started later inherit it from the thread that starts them. Returns the thread ids
    changed (none for ``normal``, which every thread already has)."""
    if priority == "normal":
        return []
    changed = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        changed.append(tid)
    return changed
