"""The engine process of ``kvgraph serve``: it builds, compiles and warms up the ``LLM`` and runs
the step loop, while the HTTP front end (``engine_client``) runs in the parent process.

The two talk over two one-way ``multiprocessing`` pipes, each message a list or a tuple:

- front end -> engine, one list of commands per send: ``("add", request id, prompt ids,
  sampling)``, ``("abort", request id)``, ``("stats", token)``, ``("stop",)``. The front end
  numbers the requests; prompts arrive tokenized and checked.
- engine -> front end: ``("ready", RequestChecks, pid, startup note)`` or ``("error", exception)``
  once; then one ``("step", records)`` per step with all of its tokens, a record being
  ``(request id, token id, finish reason, error, logprobs, prompt logprobs)`` (no text: the front
  end detokenizes); ``("failed", request ids, message)`` for the requests a failed step ended;
  ``("stats", token, LLM.stats())``.

Before each step the loop takes every command sent so far, so requests sent together join the same
step and aborted requests free their pages before it; idle, it waits for a command. It ignores
SIGINT and SIGTERM (the front end drains, then sends ``stop``) and exits when told to or when the
front end's end of the pipe closes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import EngineFailure, KVGraphError

log = logging.getLogger("kvgraph.serve")

COMPILE_POLL_S = 1.0
"""How often an idle engine looks whether its compile worker is done (``--background-compile``)."""


def engine_main(build: Callable[[], LLM], commands: Connection, events: Connection,
                inherited: tuple[Connection, ...] = ()) -> None:
    """The engine process: ``build()`` (a compiled, warm ``LLM``), say it is ready, step until stopped.

    ``inherited``: the front end's ends of the pipes, which a forked process holds too; closed
    first, so that the engine sees the front end's end close when the front end exits."""
    for connection in inherited:
        connection.close()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        llm = build()
    except Exception as e:  # reported by the front end as the CLI reports it; a KVGraphError pickles
        events.send(("error", e if isinstance(e, KVGraphError) else EngineFailure(f"{type(e).__name__}: {e}")))
        sys.exit(1)
    events.send(("ready", llm.request_checks(), os.getpid(), llm.startup_note()))
    try:
        EngineLoop(llm, commands, events).run()
    finally:
        llm.close()


class EngineLoop:
    """Steps ``llm`` for the requests that ``commands`` brings; sends each step's tokens to ``events``."""

    def __init__(self, llm: LLM, commands: Connection, events: Connection) -> None:
        self.llm, self.commands, self.events = llm, commands, events
        self._engine_ids: dict[int, int] = {}  # front end's request id -> the engine's
        self._front_ids: dict[int, int] = {}  # the engine's request id -> the front end's
        self._stopping = False

    def run(self) -> None:
        """Until ``stop`` (or the front end is gone); then every request left is aborted."""
        try:
            while not self._stopping:
                if not self.llm.has_unfinished():
                    self._idle()
                while not self._stopping and self.commands.poll():
                    self._take(self.commands.recv())
                if not self._stopping and self.llm.has_unfinished():
                    self._step()
        except (EOFError, BrokenPipeError):
            log.warning("the server's front end went away; the engine process stops")
        for request_id in list(self._engine_ids):
            self._forget(request_id)

    def _idle(self) -> None:
        """Wait for a command; while a compile worker runs, look every ``COMPILE_POLL_S`` seconds
        whether it is done, and if so load the compiled graphs now rather than in a request's step."""
        while self.llm.compiling_in_background:
            if self.commands.poll(COMPILE_POLL_S):
                break
        else:
            self.llm.wait_for_compile(timeout=0)  # a worker done: its graphs load now (at once without one)
        self._take(self.commands.recv())

    def _take(self, commands: list[tuple]) -> None:
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                if command[1] in self._engine_ids:
                    self._forget(command[1])
            elif kind == "stats":
                self.events.send(("stats", command[1], self.llm.stats()))
            elif kind == "stop":
                self._stopping = True
            else:
                raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, request_id: int, ids: list[int], sampling) -> None:
        try:
            engine_id = self.llm.add_request(ids, sampling)
        except Exception as e:  # checked by the front end already; still, the request fails, not hangs
            self.events.send(("failed", [request_id], f"the engine refused the request: {type(e).__name__}: {e}"))
            return
        self._engine_ids[request_id] = engine_id
        self._front_ids[engine_id] = request_id

    def _forget(self, request_id: int) -> None:
        """Pop the request from the engine (aborting it if it runs: its pages are freed at once)."""
        engine_id = self._engine_ids.pop(request_id)
        del self._front_ids[engine_id]
        self.llm.pop(engine_id)

    def _step(self) -> None:
        try:
            events = self.llm.step(detokenize=False)
        except Exception as e:  # a kvgraph error: the step's requests were aborted; the others go on
            log.exception("engine step failed")
            ended = [r for r, e_id in self._engine_ids.items() if self.llm.completion(e_id).finish_reason is not None]
            for request_id in ended:
                self._forget(request_id)
            self.events.send(("failed", ended, f"the engine step failed: {type(e).__name__}: {e}"))
            return
        records = []
        for event in events:
            request_id = self._front_ids[event.request_id]
            records.append((request_id, event.token_id, event.finish_reason, event.error, event.logprobs,
                            event.prompt_logprobs))
            if event.finish_reason is not None:
                self._forget(request_id)
        self.events.send(("step", records))
