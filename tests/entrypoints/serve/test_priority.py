"""``kvgraph serve --frontend-priority``: the front end's threads at Linux's ``SCHED_IDLE`` while
the engine process keeps the normal policy; ``auto`` picks ``idle`` only where the engine's kernel
threads take every core, with a guard that puts the front end back at the normal priority when its
event loop goes without a turn too long; settings it cannot honour are refused before anything
starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraph.entrypoints.cli.serve import FRONTEND_PRIORITIES
from kvgraph.entrypoints.serve import priority
from kvgraph.errors import ConfigError
from tests.entrypoints.serve.serving import ENGINE_FLAGS, MODEL, post

needs_sched_idle = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux's SCHED_IDLE")


def _policies(pid: int) -> dict[int, int]:
    """Each thread of process ``pid``: its scheduling policy."""
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_auto_is_idle_only_where_the_engine_takes_every_core():
    idle = "idle" if priority.reversible() else "normal"  # and only where the guard could undo it
    assert priority.resolve("auto", 2, 2) == idle
    assert priority.resolve("auto", 4, 2) == idle  # tensor-parallel ranks' threads together
    assert priority.resolve("auto", 3, 4) == "normal"  # a core left to the front end
    assert priority.resolve("normal", 2, 2) == "normal"
    assert priority.resolve("idle", 1, 8) == "idle"


def test_the_command_line_offers_the_priorities_without_importing_the_server():
    assert FRONTEND_PRIORITIES == priority.PRIORITIES
    script = """
import sys
from kvgraph.entrypoints.cli import build_parser
args = build_parser().parse_args(["serve", "--model", "llama-tiny", "--frontend-priority", "idle"])
print(args.frontend_priority, "fastapi" in sys.modules, "kvgraph.entrypoints.serve" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3]).stdout.split()
    assert out == ["idle", "False", "False"]


def test_settings_that_cannot_be_honoured_are_refused():
    with pytest.raises(ConfigError, match="'lowest' is not one of auto, normal, idle"):
        priority.check("lowest", True)
    with pytest.raises(ConfigError, match="--frontend-priority idle needs the engine in its own process"):
        priority.check("idle", False)
    priority.check("auto", False)  # auto with the engine in a thread: normal, nothing to refuse
    priority.check("normal", False)


@needs_sched_idle
def test_apply_sets_every_thread_and_the_threads_started_later():
    script = """
import json, os, threading, time
from kvgraph.entrypoints.cli.serve import FRONTEND_PRIORITIES
from kvgraph.entrypoints.serve import priority
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
changed = priority.apply("idle")
after = threading.Thread(target=stop.wait); after.start()
time.sleep(0.1)
policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({"changed": len(changed), "policies": sorted(set(policies.values())), "threads": len(policies)}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    cwd=Path(__file__).parents[3]).stdout)
    assert out["changed"] >= 2  # the main thread and the one started before
    assert out["threads"] >= 3
    assert out["policies"] == [os.SCHED_IDLE]


needs_reversible = pytest.mark.skipif(not priority.reversible(),
                                      reason="needs a thread that may leave SCHED_IDLE (root or RLIMIT_NICE)")


@needs_reversible
def test_the_guard_puts_a_front_end_whose_loop_waits_too_long_back_at_normal():
    script = """
import asyncio, json, os, time
from kvgraph.entrypoints.cli.serve import FRONTEND_PRIORITIES
from kvgraph.entrypoints.serve import priority
policies = lambda: sorted(os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task"))
guard = priority.StarvationGuard(limit_s=0.5)
guard.start()
started = policies()
async def main():
    guard.watch_loop(asyncio.get_running_loop())
    await asyncio.sleep(0.3)  # beating every 0.05 s
    beating = guard.level
    time.sleep(1.5)  # the loop gets no turn, as beside processes that keep the cores busy
    await asyncio.sleep(0.2)
    return beating
beating = asyncio.run(main())
print(json.dumps({"started": started, "beating": beating, "after": guard.level, "late": guard.starved_s,
                  "policies": policies()}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    cwd=Path(__file__).parents[3]).stdout)
    assert out["started"] == sorted([os.SCHED_OTHER] + [os.SCHED_IDLE] * (len(out["started"]) - 1))  # the watchdog
    assert out["beating"] == "idle"
    assert out["after"] == "normal" and 0.5 < out["late"] < 1.6
    assert set(out["policies"]) == {os.SCHED_OTHER}


@needs_sched_idle
def test_an_idle_front_end_beside_a_normal_engine_process(start_server):
    server = start_server(*ENGINE_FLAGS, "--frontend-priority", "idle")
    engine_pid = int(server.metric("kvgraph_engine_pid"))
    assert "front end at idle priority" in next(line for line in server.log if "ready: serving" in line)
    assert set(_policies(server.proc.pid).values()) == {os.SCHED_IDLE}
    assert set(_policies(engine_pid).values()) == {os.SCHED_OTHER}
    request = {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}
    code, body = post(server, "/v1/completions", json.dumps(request).encode())
    assert code == 200 and body["usage"]["completion_tokens"] == 3
    assert set(_policies(server.proc.pid).values()) == {os.SCHED_IDLE}  # threads started since, too


def test_a_normal_front_end_keeps_the_normal_policy(start_server):
    server = start_server(*ENGINE_FLAGS, "--frontend-priority", "normal")
    assert "front end at normal priority" in next(line for line in server.log if "ready: serving" in line)
    assert set(_policies(server.proc.pid).values()) == {os.SCHED_OTHER}
