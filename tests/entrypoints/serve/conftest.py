"""``kvgraph serve`` as users run it: a subprocess of this interpreter on a free 127.0.0.1 port."""

from __future__ import annotations

import pytest

from kvgraph.entrypoints.serve.launch import ServerProcess


@pytest.fixture(scope="session")
def start_server():
    """``start_server(*args)`` -> a ready ``ServerProcess``; every one is stopped at the end."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        try:
            server.wait_ready()
        except RuntimeError as e:
            pytest.fail(str(e))
        return server

    yield start
    for server in started:
        server.kill()
