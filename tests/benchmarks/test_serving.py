"""``benchmarks/serving.py``'s load generator: ``--client-priority idle`` runs the load in a thread under
``SCHED_IDLE`` and leaves the calling thread's policy alone; its results and errors come back."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")


@pytest.fixture(scope="module")
def serving():
    pytest.importorskip("aiohttp")
    pytest.importorskip("httpx2")
    spec = importlib.util.spec_from_file_location("benchmarks_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("priority, policy", [("idle", os.SCHED_IDLE), ("normal", os.SCHED_OTHER)])
def test_the_load_runs_under_the_asked_policy(serving, monkeypatch, priority, policy):
    seen = {}

    async def fake_load(url, model, prompts, max_new_tokens, concurrency, client):
        seen["policy"] = os.sched_getscheduler(0)
        seen["args"] = (url, model, prompts, max_new_tokens, concurrency, client)
        return [{"text": "x"}], 1.5

    before = os.sched_getscheduler(0)
    monkeypatch.setattr(serving, "load", fake_load)
    results, elapsed = serving.run_load("http://h", "m", [[3, 4]], 2, 1, "aiohttp", priority)
    assert (results, elapsed) == ([{"text": "x"}], 1.5)
    assert seen["policy"] == policy
    assert seen["args"] == ("http://h", "m", [[3, 4]], 2, 1, "aiohttp")
    assert os.sched_getscheduler(0) == before  # the caller's thread keeps its policy


def test_an_error_in_the_load_reaches_the_caller(serving, monkeypatch):
    async def failing_load(*args):
        raise ConnectionError("server went away")

    monkeypatch.setattr(serving, "load", failing_load)
    with pytest.raises(ConnectionError, match="server went away"):
        serving.run_load("http://h", "m", [[3]], 1, 1, "aiohttp", "idle")
