"""``kvgraph serve``'s engine process threads without ``--threads``: a core left to the HTTP front
end only on hosts of more than 2 cores."""

import pytest

from kvgraph.entrypoints.cli import serve


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 2), (16, 15)])
def test_engine_threads_leave_a_core_to_the_front_end_past_two_cores(monkeypatch, cores, threads):
    monkeypatch.setattr(serve.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert serve.engine_threads() == threads
