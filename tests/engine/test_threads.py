"""The thread governor: intra-op threads follow the cores other processes leave free."""

import os
import subprocess
import sys
import time

import pytest
import torch

from kvgraph.engine import threads as governed
from kvgraph.engine.threads import CpuSample, ThreadGovernor, read_sample


@pytest.fixture
def restore_threads():
    """Two threads during the test (the governors here start from 2), the count as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _feed(monkeypatch, samples):
    """``read_sample`` returns ``samples`` in order; the clock is each sample's wall time."""
    it = iter(samples)
    current = {}

    def fake_read(cores):
        current["s"] = next(it)
        return current["s"]

    monkeypatch.setattr(governed, "read_sample", fake_read)
    monkeypatch.setattr(governed.time, "monotonic", lambda: current["s"].wall + 1.0)


@pytest.mark.parametrize(
    ("busy", "own", "threads"),
    [
        (2.0, 2.0, 2),  # only this process ran: both cores stay
        (2.0, 1.9, 2),  # others took 0.1 core: noise, not a taken core
        (2.0, 1.0, 1),  # others took a whole core
        (1.6, 1.0, 1),  # others took 0.6 core: past BUSY_FRACTION, the core counts as taken
        (2.0, 0.0, 1),  # others took both: still one thread
    ],
)
def test_threads_are_the_cores_other_processes_leave(monkeypatch, restore_threads, busy, own, threads):
    _feed(monkeypatch, [CpuSample(0.0, 0.0, 0.0), CpuSample(1.0, busy, own)])
    governor = ThreadGovernor(2, interval_s=0.5)
    governor.cores = frozenset({0, 1})
    assert governor.update() == threads
    assert torch.get_num_threads() == 2  # the engine applies the count per step, past Dynamo's guards
    assert governor.others == pytest.approx(busy - own)
    assert governor.changes == (threads != 2)


def test_threads_come_back_when_the_other_process_stops(monkeypatch, restore_threads):
    _feed(monkeypatch, [CpuSample(0.0, 0.0, 0.0), CpuSample(1.0, 2.0, 1.0), CpuSample(2.0, 4.0, 3.0)])
    governor = ThreadGovernor(2, interval_s=0.5)
    governor.cores = frozenset({0, 1})
    assert governor.update() == 1
    assert governor.update() == 2 and governor.changes == 2


def test_no_decision_before_the_interval_has_passed(monkeypatch, restore_threads):
    governor = ThreadGovernor(2, interval_s=3600)
    monkeypatch.setattr(governed, "read_sample", lambda cores: pytest.fail("sampled within the interval"))
    assert governor.update() == 2


def test_one_thread_is_never_changed(monkeypatch, restore_threads):
    governor = ThreadGovernor(1, interval_s=0.0)
    monkeypatch.setattr(governed, "read_sample", lambda cores: pytest.fail("sampled with one thread"))
    assert governor.update() == 1


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) != 2,
                    reason="reads /proc/stat of a 2-core affinity set")
def test_a_process_spinning_on_one_of_two_cores_leaves_one_thread(restore_threads):
    core = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass"])
    try:
        governor = ThreadGovernor(2, interval_s=0.0)
        time.sleep(1.0)
        assert governor.update() == 1 and governor.others > 0.5
    finally:
        hog.kill()
        hog.wait()


def test_read_sample_counts_this_process_within_the_cores_busy_time():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    cores = frozenset(os.sched_getaffinity(0))
    first = read_sample(cores)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    second = read_sample(cores)
    assert second.own - first.own >= 0.28  # os.times counts in 10 ms ticks: up to one short, and float sums
    assert second.busy - first.busy >= second.own - first.own - 0.05  # ticks are 10 ms
