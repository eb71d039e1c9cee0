"""Start ``kvgraph serve`` as a subprocess of this interpreter and talk to it: for tests and
load scripts that measure the server as users run it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

READY = re.compile(r"ready: serving (\S+) on (http://[^\s:]+:\d+)")


class ServerProcess:
    """``kvgraph serve ARGS --host HOST --port 0``, in ``env`` (default: this process's
    environment); ``url`` once it logged its ready line.

    stderr is read by a thread all along (a full pipe would block the server) and kept in ``log``.
    """

    def __init__(self, *args: str, host: str = "127.0.0.1", startup_timeout: float = 600,
                 stop_timeout: float = 120, env: dict[str, str] | None = None) -> None:
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgraph.entrypoints.cli", "serve", *args, "--host", host, "--port", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ if env is None else env),
        )
        self.log: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            match = READY.search(line)
            if match:
                self.url = match.group(2)
                self._ready.set()
        self._ready.set()  # the process ended: wait_ready stops waiting

    def wait_ready(self) -> str:
        """The server's URL once it is ready; ``RuntimeError`` (with its last log lines) if it
        exits or is not ready within ``startup_timeout`` seconds."""
        self._ready.wait(self.startup_timeout)
        if self.url is None:
            self.kill()
            raise RuntimeError("kvgraph serve did not get ready:\n" + "".join(self.log[-40:]))
        return self.url

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return response.read().decode()

    def metric(self, name: str) -> float:
        """The value of a metric in ``/metrics`` (summed over its label sets unless ``name``
        gives them: ``kvgraph_requests_finished_total{finish_reason="abort"}``)."""
        values = [float(line.split()[-1]) for line in self.get("/metrics").splitlines()
                  if line.startswith(name + " ") or line.startswith(name + "{")]
        if not values:
            raise KeyError(f"{name} not in /metrics")
        return sum(values)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and return the exit status (killed after ``stop_timeout`` seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(self.stop_timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(self.stop_timeout)
        self._reader.join(self.stop_timeout)
