"""``kvgraph serve`` as users run it: a subprocess of this interpreter on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 120
READY = re.compile(r"ready: serving (\S+) on (http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """``kvgraph serve ARGS --host 127.0.0.1 --port 0``; ``url`` once it logged its ready line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgraph.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        )
        self.log: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        """Keep the pipe drained (a full pipe would block the server) and spot the ready line."""
        for line in self.proc.stderr:
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(2)
                self._ready.set()
        self._ready.set()  # the process ended: wait_ready stops waiting

    def wait_ready(self) -> str:
        self._ready.wait(STARTUP_TIMEOUT_S)
        if self.url is None:
            self.kill()
            pytest.fail("kvgraph serve did not get ready:\n" + "".join(self.log[-40:]))
        return self.url

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return response.read().decode()

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric (or the sum over its label sets) in ``/metrics``."""
        values = [float(line.split()[-1]) for line in self.get("/metrics").splitlines()
                  if line.startswith(name + " ") or line.startswith(name + "{")]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def start_server():
    """``start_server(*args)`` -> a ready ``ServerProcess``; every one is stopped at the end."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.kill()
