"""The HTTP front end's CPU priority against the engine process's kernel threads.

On a host with no core to spare, the front end's work (parsing requests, tokenizing, writing
chunks) lands on a core that one of the engine's kernel threads holds. An OpenMP region ends with
its slowest thread, so every layer of the step then waits while the front end runs. At the
``idle`` priority (Linux's ``SCHED_IDLE``) the front end runs when a core has nothing else to do:
between the engine's kernels and steps, while its own threads' work waits a little. The engine
process keeps the normal priority (it was started before the change, and a thread's scheduling
policy is per thread).

``SCHED_IDLE`` has a hazard: another process that keeps the cores busy (a neighbour's job) leaves
the front end almost no CPU while the engine runs. Measured beside one busy process, ``/health``
then took 1.2-2.5 s and a first token 2.5 s. So ``auto`` (the default) comes with a
:class:`StarvationGuard`: the server's event loop beats every ``BEAT_S``, a watchdog thread at the
normal priority checks the beat, and if it is older than ``STARVED_S`` every thread of the front
end goes back to the normal priority for good (logged). ``auto`` is ``idle`` where the
engine's kernel threads take every core the process may run on, Linux has ``SCHED_IDLE`` and a
thread here may go back from it (root, or ``RLIMIT_NICE`` allowing nice 0); else ``normal``.
``idle`` asked for explicitly is idle for good, without the guard.

Measured on a 2-core host at 32 streams (``benchmarks/RESULTS.md``): ``llama-56m`` served 1.07x
the tokens/s of a normal-priority front end (median of 14 pairs), for inter-token latencies of
0.07-0.11 s at p99 instead of 0.03; ``/health`` answered in 9-12 ms (p50, at most 0.3 s) during a
long prefill-heavy load instead of 1 ms.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from kvgraph.errors import ConfigError

log = logging.getLogger("kvgraph.serve")

PRIORITIES = ("auto", "normal", "idle")
BEAT_S = 0.05
"""How often the server's event loop beats for the guard."""
STARVED_S = 1.0
"""A beat this late: the front end is starved at the idle priority. Without a busy neighbour its
waits measured at most 0.3 s under a prefill-heavy load; beside one, 1.2-2.5 s."""


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


def reversible() -> bool:
    """Whether a thread of this process may go from ``SCHED_IDLE`` back to ``SCHED_OTHER``
    (tried on a thread of its own, which ends)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="kvgraph-priority-probe")
    thread.start()
    thread.join()
    return result[0]


def resolve(priority: str, engine_threads: int, cores: int) -> str:
    """``normal`` or ``idle``: what ``priority`` (checked by :func:`check`) means for a front end in
    its own process beside an engine of ``engine_threads`` kernel threads (all its ranks') on
    ``cores`` cores."""
    if priority != "auto":
        return priority
    return "idle" if engine_threads >= cores and reversible() else "normal"


def _set_policy(policy: int, keep: frozenset[int] = frozenset()) -> list[int]:
    """Every thread of this process but ``keep`` under ``policy``; the thread ids changed."""
    changed = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in keep:
            continue
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        changed.append(tid)
    return changed


def apply(priority: str, keep: frozenset[int] = frozenset()) -> list[int]:
    """Put every thread of this process but ``keep`` at ``priority`` (``normal`` or ``idle``: see
    :func:`resolve`); threads started later inherit it from the thread that starts them. Returns
    the thread ids changed (none for ``normal``, which every thread already has)."""
    if priority == "normal":
        return []
    return _set_policy(os.SCHED_IDLE, keep)


class StarvationGuard:
    """The front end at the idle priority until it starves, then at the normal one for good.

    :meth:`start` starts the watchdog thread (at the normal priority, as the calling thread still
    is) and puts every other thread at the idle priority. :meth:`watch_loop`, called in the
    server's event loop, makes that loop beat every ``beat_s``. A beat later than ``limit_s``
    means the loop waited that long for a core: requests and chunks queue up behind it. The
    watchdog then puts every thread back at the normal priority. A sleeping thread would not do
    as the probe: one at the idle priority is still woken within a few milliseconds beside busy
    processes; it is the CPU share that it lacks. ``level`` is ``"idle"``, then ``"normal"`` once
    the guard has acted; ``starved_s`` is how late the beat was then.
    """

    def __init__(self, limit_s: float = STARVED_S, beat_s: float = BEAT_S) -> None:
        self.limit_s, self.beat_s = limit_s, beat_s
        self.level = "normal"
        self.starved_s: float | None = None
        self._beat: float | None = None  # the loop's last beat (None before watch_loop)
        self._stop = threading.Event()

    def start(self) -> None:
        watchdog = threading.Thread(target=self._watch, name="kvgraph-priority-watchdog", daemon=True)
        watchdog.start()  # returns once the thread runs, its native_id known
        apply("idle", keep=frozenset({watchdog.native_id}))
        self.level = "idle"

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Beat in ``loop`` (call it there) until the guard stops."""
        def beat() -> None:
            self._beat = time.monotonic()
            if not self._stop.is_set():
                loop.call_later(self.beat_s, beat)

        beat()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self.level != "idle" or self._beat is None:
                continue
            late = time.monotonic() - self._beat
            if late > self.limit_s:
                _set_policy(os.SCHED_OTHER)
                self.level, self.starved_s = "normal", late
                self._stop.set()
                log.warning("the front end's event loop waited %.2f s for a core at idle priority (another "
                            "process keeps the cores busy): back to normal priority", late)
                return
