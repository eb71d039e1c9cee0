"""``kvgraph serve`` runs its engine in a second process (``--no-frontend-process``: in a thread of
its own): a disconnect still frees the pages there, SIGTERM drains and stops both processes, and
an engine process that dies turns the requests in flight into OpenAI error bodies."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import urllib.parse
from pathlib import Path

import pytest

from tests.entrypoints.serve.serving import ENGINE_FLAGS, MODEL, all_pages_free, post, wait_until


def _parent(pid: int) -> int:
    """The parent process id of ``pid`` (from ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


def _open_stream(server, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion of ``max_tokens`` tokens, its first chunk read."""
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # the first token arrived
    return conn, response


@pytest.fixture(scope="module", params=["engine process", "engine thread"])
def any_server(request, start_server):
    """A server with its engine in its own process (the default), and one with it in a thread."""
    flags = [] if request.param == "engine process" else ["--no-frontend-process"]
    return start_server(*ENGINE_FLAGS, *flags)


def test_the_engine_runs_in_a_child_process_by_default(server):
    engine_pid = int(server.metric("kvgraph_engine_pid"))
    assert engine_pid != server.proc.pid
    assert _parent(engine_pid) == server.proc.pid
    assert f"engine process {engine_pid}" in next(line for line in server.log if "ready: serving" in line)


def test_no_frontend_process_runs_the_engine_in_the_server(start_server):
    server = start_server(*ENGINE_FLAGS, "--no-frontend-process")
    assert int(server.metric("kvgraph_engine_pid")) == server.proc.pid
    request = {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}  # random weights may pick EOS
    code, body = post(server, "/v1/completions", json.dumps(request).encode())
    assert code == 200 and body["usage"]["completion_tokens"] == 3
    assert server.stop(signal.SIGTERM) == 0


def test_a_disconnect_frees_the_pages_in_the_engine(any_server):
    aborted = 'kvgraph_requests_finished_total{finish_reason="abort"}'
    before = any_server.metric(aborted)
    conn, _ = _open_stream(any_server, 400)
    assert any_server.metric("kvgraph_kv_pages_used") > 0
    conn.close()
    assert wait_until(lambda: any_server.metric(aborted) == before + 1)
    assert all_pages_free(any_server)


def test_sigterm_drains_then_stops_both_processes(start_server):
    server = start_server(*ENGINE_FLAGS)
    engine_pid = int(server.metric("kvgraph_engine_pid"))
    conn, response = _open_stream(server, 100)
    assert server.stop(signal.SIGTERM) == 0
    lines = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 100
    assert any(f"engine process {engine_pid} exited with status 0" in line for line in server.log), server.log[-10:]
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)


def test_a_killed_engine_process_ends_the_requests_in_flight_with_error_bodies(start_server):
    server = start_server(*ENGINE_FLAGS)
    engine_pid = int(server.metric("kvgraph_engine_pid"))
    conn, response = _open_stream(server, 480)
    whole: dict = {}

    def complete() -> None:
        body = {"model": MODEL, "prompt": "another long story", "max_tokens": 480, "temperature": 0,
                "ignore_eos": True}
        whole["answer"] = post(server, "/v1/completions", json.dumps(body).encode())

    thread = threading.Thread(target=complete, daemon=True)
    thread.start()
    assert wait_until(lambda: server.metric("kvgraph_requests_running") == 2)
    os.kill(engine_pid, signal.SIGKILL)

    rest = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and "engine process was killed by SIGKILL" in error["message"]
    thread.join(120)
    code, body = whole["answer"]
    assert code == 500 and body["error"]["type"] == "server_error"
    assert "engine process was killed by SIGKILL" in body["error"]["message"]
    assert server.proc.wait(120) == 1  # the server stops on its own
