"""Run the app under uvicorn: one "ready" line once listening, a clean exit on SIGTERM / Ctrl-C.

On the first SIGTERM or SIGINT the server stops accepting connections, lets the requests in
flight finish (for at most ``shutdown_timeout`` seconds, then aborts them, freeing their pages),
stops the engine (its process, or its thread) and returns 0; a second Ctrl-C quits at once. An
engine process that dies stops the server the same way (its requests ended with error bodies),
and ``serve`` returns 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from kvgraph.entrypoints.serve.app import build_app
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.engine_client import EngineClient
from kvgraph.entrypoints.serve.priority import StarvationGuard

log = logging.getLogger("kvgraph.serve")


class _Server(uvicorn.Server):
    """uvicorn that logs where it listens once it does, and does not re-raise the signal that
    stopped it (uvicorn's default, which would turn a clean shutdown into a signal exit status).
    ``startup``: how the engine started (time, compiled graphs reused or not), for the ready line;
    ``guard``: watches the event loop from when the server listens until it shuts down."""

    def __init__(self, config: uvicorn.Config, startup: str = "", guard: StarvationGuard | None = None) -> None:
        super().__init__(config)
        self.startup_note = startup
        self.guard = guard

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_soon(self) -> None:
        """Begin the shutdown a signal begins (from any thread)."""
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            note = f" ({self.startup_note})" if self.startup_note else ""
            log.info("ready: serving %s on http://%s:%d%s", self.config.app.state.serve.model_name, host, port, note)
            if self.guard is not None:
                self.guard.watch_loop(asyncio.get_running_loop())

    async def shutdown(self, sockets=None) -> None:
        if self.guard is not None:
            self.guard.stop()  # the loop's beats end with it, which is no starvation
        await super().shutdown(sockets)


def serve(engine: AsyncEngine | EngineClient, model_name: str, host: str, port: int, shutdown_timeout: float,
          startup: str = "", guard: StarvationGuard | None = None) -> int:
    """Serve ``engine`` (its model compiled and warm) until SIGTERM or Ctrl-C, or until its engine
    process dies; returns the exit status (0; 1 if the engine process died). ``startup`` goes into
    the ready line (how long the start took, whether compiled graphs were reused); ``guard`` (the
    front end's :class:`~kvgraph.entrypoints.serve.priority.StarvationGuard`, started) watches the
    server's event loop while it serves. uvicorn runs on
    uvloop and httptools where they are installed (the ``serve`` extra installs them): 94 against
    134 us of this process's CPU per streamed chunk with its pure-Python event loop and parser."""
    app = build_app(engine, model_name)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False,
        timeout_graceful_shutdown=shutdown_timeout,
    )
    server = _Server(config, startup, guard)
    if isinstance(engine, EngineClient):
        engine.on_exit = server.stop_soon
    server.run()
    log.info("stopped")
    return 0 if engine.exit_reason is None else 1
