"""``EngineClient``: the HTTP front end's side of the engine process (``engine_process``), with the
interface of ``AsyncEngine``, so tokenization, pydantic and server-sent events never take the
engine's GIL. The engine process is forked where that is safe (:func:`start_method`), else spawned.

``submit`` tokenizes and checks a request here (``RequestChecks``, the engine's own checks, sent
over with the tokenizer once the engine is ready), numbers it and queues an ``add`` command; a
sender thread sends what queued up as one message, so requests sent together reach the engine
together. A reader thread receives one message per step, detokenizes its tokens and hands them to
the event loop in one callback. If the engine process dies, every request in flight ends with an
``EngineFailure`` (an OpenAI error body), later ones are refused, and ``on_exit`` is called.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from kvgraph.engine import SamplingParams
from kvgraph.engine.detokenize import IncrementalDetokenizer
from kvgraph.engine.prompts import Prompt, RequestChecks
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.engine_process import engine_main
from kvgraph.entrypoints.serve.metrics import ServeMetrics
from kvgraph.entrypoints.serve.streams import RequestHandle, Stream, StreamTable
from kvgraph.errors import EngineFailure
from kvgraph.parallel.spawn import describe_exit

log = logging.getLogger("kvgraph.serve")

STATS_TIMEOUT_S = 60.0
"""How long ``/metrics`` waits for the engine's figures (it answers between steps)."""


def start_method() -> str:
    """How the engine process starts: ``fork`` where that is safe, so that it inherits the modules
    this process imported (torch, transformers' tokenizer, kvgraph: about 2 s of a start); else
    ``spawn``. Safe means one thread here (a fork copies only the calling one) and no CUDA device
    (CUDA cannot be used again in a forked child once the parent asked for it, as
    ``torch.cuda.is_available()`` does). No tensor work runs here before the fork, so no OpenMP
    pool is copied either."""
    import torch

    if ("fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
            and not torch.cuda.is_available()):
        return "fork"
    return "spawn"


class EngineClient:
    """The engine process, driven from the front end: ``submit`` and ``abort`` are for the event loop.

    Attributes:
        checks: the engine's request checks (with its tokenizer).
        pid: the engine process's id.
        startup_note: how the engine's compiled graphs came to be (``LLM.startup_note``).
        metrics: the server's metrics, the engine's figures fetched from the engine process.
        exit_reason: why the engine process ended unasked (``None`` while it runs or once stopped).
        on_exit: called (from the reader thread) once the engine process ended unasked.

    ``stream_interval``: the tokens each stream hands on together (``StreamTable``).
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, commands: Connection, events: Connection,
                 checks: RequestChecks, pid: int, startup_note: str, stream_interval: int = 1) -> None:
        self.checks, self.pid, self.startup_note = checks, pid, startup_note
        self.metrics = ServeMetrics(self.stats, pid)
        self.exit_reason: str | None = None
        self.on_exit: Callable[[], None] | None = None
        self._process, self._commands, self._events = process, commands, events
        self._streams = StreamTable(self.metrics, stream_interval)
        self._ids = itertools.count()  # request ids (the front end's; the engine maps them to its own)
        self._outbox: deque[tuple] = deque()  # commands for the sender thread
        self._wake = threading.Event()
        self._stats: dict[int, Future] = {}  # token -> the stats request waiting for it
        self._stopping = False
        self._sender = threading.Thread(target=self._send_loop, name="kvgraph-engine-sender", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="kvgraph-engine-reader", daemon=True)

    @classmethod
    def launch(cls, build: Callable[[], LLM], stream_interval: int = 1) -> EngineClient:
        """Start the engine process, which runs ``build()`` (picklable: it must return a compiled,
        warm ``LLM``), and wait until it is ready. Raises what ``build`` raised there (an error other
        than a ``KVGraphError`` as an ``EngineFailure``). ``stream_interval``: see ``StreamTable``."""
        StreamTable.check_interval(stream_interval)  # before the engine process starts
        method = start_method()
        ctx = multiprocessing.get_context(method)
        commands_out, commands_in = ctx.Pipe(duplex=False)
        events_out, events_in = ctx.Pipe(duplex=False)
        inherited = (commands_in, events_out) if method == "fork" else ()
        process = ctx.Process(target=engine_main, args=(build, commands_out, events_in, inherited),
                              name="kvgraph-engine")
        process.start()
        commands_out.close()  # the engine's ends: closed here, so that either side sees the other exit
        events_in.close()
        previous = signal.signal(signal.SIGTERM, _interrupt)  # stop the engine too if stopped while it starts
        try:
            message = events_out.recv()
        except EOFError:
            process.join()
            raise EngineFailure(f"the engine process {describe_exit(process.exitcode)} before it was ready") from None
        except BaseException:
            process.kill()
            process.join()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        if message[0] == "error":
            process.join()
            raise message[1]
        _, checks, pid, note = message
        return cls(process, commands_in, events_out, checks, pid, note, stream_interval)

    # -- event loop side --
    def start(self) -> None:
        self._sender.start()
        self._reader.start()

    async def submit(self, prompt: Prompt, sampling: SamplingParams) -> RequestHandle:
        """Queue a request for the next step. Raises what ``LLM.add_request`` raises for a bad
        prompt or sampling, at once and queueing nothing; ``EngineFailure`` once the engine is gone."""
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str):  # a tokenizer call can take a while: not on the event loop
            ids = await loop.run_in_executor(None, self.checks.encode, prompt, sampling)
        else:
            ids = self.checks.encode(prompt, sampling)
        tokenizer = self.checks.tokenizer
        stream = Stream(loop, detokenizer=IncrementalDetokenizer(tokenizer) if tokenizer is not None else None)
        request_id = next(self._ids)
        self._streams.add(request_id, stream)
        # checked after the stream is in the table: the reader thread ends every stream it holds
        # once it has set exit_reason, so a request is refused here or failed there, never left waiting
        if self._stopping or self.exit_reason is not None:
            self._streams.drop(request_id, None)
            raise EngineFailure(self.exit_reason or "the server is shutting down")
        self._command(("add", request_id, ids, sampling))
        return RequestHandle(self, request_id, len(ids), stream)

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Have the engine abort the request before its next step (returns at once)."""
        if self._streams.drop(request_id, reason):
            self._command(("abort", request_id))

    def stats(self) -> dict:
        """``LLM.stats()`` of the engine (blocks until the engine answers, between steps)."""
        token, future = next(self._ids), Future()
        self._stats[token] = future
        if self.exit_reason is not None:  # after registering: see submit
            self._stats.pop(token, None)
            raise EngineFailure(self.exit_reason)
        self._command(("stats", token))
        return future.result(STATS_TIMEOUT_S)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine process and wait for it (killed after ``timeout`` s)."""
        self._stopping = True
        self._command(("stop",))
        self._reader.join(timeout)  # it ends once the engine process has exited, and reaps it
        if self._reader.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout)
            self._process.kill()
            self._reader.join()
        log.info("engine process %d %s", self.pid, describe_exit(self._process.exitcode))

    # -- threads --
    def _command(self, command: tuple) -> None:
        self._outbox.append(command)
        self._wake.set()

    def _send_loop(self) -> None:
        """Send the queued commands, all those queued since the last send as one message."""
        while True:
            self._wake.wait()
            self._wake.clear()
            batch = []
            while self._outbox:
                batch.append(self._outbox.popleft())
            try:
                self._commands.send(batch)
            except OSError:  # the engine process is gone: the reader thread reports it
                return
            if any(command[0] == "stop" for command in batch):
                return

    def _read_loop(self) -> None:
        """Hand each step's tokens to their requests, until the engine process ends."""
        try:
            while True:
                message = self._events.recv()
                kind = message[0]
                if kind == "step":
                    self._streams.dispatch(self._streams.texts(message[1]))
                elif kind == "failed":
                    self._streams.fail(message[1], message[2])
                elif kind == "stats":
                    future = self._stats.pop(message[1], None)
                    if future is not None:
                        future.set_result(message[2])
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here must not leave requests waiting: end the engine with them
            log.exception("reading the engine process's messages failed")
            self._process.kill()
        self._process.join()
        if not self._stopping:
            self.exit_reason = f"the engine process {describe_exit(self._process.exitcode)}"
            log.error("%s; the server stops", self.exit_reason)
        message = self.exit_reason or "the server is shutting down"
        self._streams.fail(None, message)
        for token in list(self._stats):
            future = self._stats.pop(token, None)
            if future is not None:
                future.set_exception(EngineFailure(message))
        if self.exit_reason is not None and self.on_exit is not None:
            self.on_exit()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
