"""``AsyncEngine``: one ``kvgraph.LLM`` behind an async bridge, so the event loop never runs a step.

One engine thread owns the stepping: while any request is unfinished it calls ``LLM.step()``
and hands each token to the asyncio queue of the request it belongs to; idle, it sleeps until a
request arrives. Handlers queue requests with the thread-safe ``LLM.add_request`` from a worker
thread (it waits for the step in flight), and abort without waiting: the engine thread applies
aborts before its next step, freeing the pages at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvgraph.engine import LLM, SamplingParams, TokenEvent
from kvgraph.engine.prompts import Prompt
from kvgraph.serve.metrics import ServeMetrics

log = logging.getLogger("kvgraph.serve")


class EngineFailure(RuntimeError):
    """The step running a request failed (or the server stopped); the request was aborted."""


@dataclass
class _Stream:
    """Where the engine thread puts one request's tokens: ``TokenEvent``s, or an ``EngineFailure``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def put(self, item: TokenEvent | EngineFailure) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class RequestHandle:
    """One queued request: iterate it for its tokens; ``abort()`` if it is left early."""

    def __init__(self, engine: AsyncEngine, request_id: int, prompt_tokens: int, stream: _Stream) -> None:
        self.engine, self.request_id, self.prompt_tokens = engine, request_id, prompt_tokens
        self.stream = stream
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they come; the last one has a ``finish_reason``. Raises
        ``EngineFailure`` if the engine aborted the request."""
        while not self.finished:
            item = await self.stream.queue.get()
            if isinstance(item, EngineFailure):
                self.finished = True
                raise item
            self.finished = item.finish_reason is not None
            yield item

    def abort(self, reason: str = "abort") -> None:
        """Stop the request (no-op once finished); returns at once, the pages are freed before the
        next step. ``reason`` is what the metrics count it as ("stop" for a stop string)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id, reason)


class AsyncEngine:
    """Drives ``llm`` from one engine thread; ``submit`` and ``abort`` are for the event loop."""

    def __init__(self, llm: LLM, metrics: ServeMetrics) -> None:
        self.llm, self.metrics = llm, metrics
        self._streams: dict[int, _Stream] = {}  # request id -> where its tokens go
        self._guard = threading.Lock()  # _streams; held while queueing, so no token precedes its stream
        self._aborts: deque[tuple[int, str]] = deque()  # (request id, reason), from any thread
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvgraph-engine", daemon=True)

    # -- event loop side --
    def start(self) -> None:
        self._thread.start()

    async def submit(self, prompt: Prompt, sampling: SamplingParams) -> RequestHandle:
        """Queue a request. Raises what ``LLM.add_request`` raises for a bad prompt or sampling."""
        stream = _Stream(asyncio.get_running_loop())
        added = stream.loop.run_in_executor(None, self._add, prompt, sampling, stream)
        try:
            request_id, prompt_tokens = await asyncio.shield(added)
        except asyncio.CancelledError:  # the client left while the request was being queued
            added.add_done_callback(lambda f: f.exception() is None and self.abort(f.result()[0]))
            raise
        return RequestHandle(self, request_id, prompt_tokens, stream)

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Have the engine thread abort the request before its next step (returns at once)."""
        self._aborts.append((request_id, reason))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, end the engine thread and wait for it."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # -- worker thread --
    def _add(self, prompt: Prompt, sampling: SamplingParams, stream: _Stream) -> tuple[int, int]:
        with self._guard:
            request_id = self.llm.add_request(prompt, sampling)
            self._streams[request_id] = stream
            prompt_tokens = self.llm.completion(request_id).prompt_tokens
        self._wake.set()
        return request_id, prompt_tokens

    # -- engine thread --
    def _run(self) -> None:
        while not self._stopping:
            self._apply_aborts()
            if not self.llm.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                events = self.llm.step()
            except Exception as e:  # a kvgraph error: the step's requests were aborted; the others go on
                log.exception("engine step failed")
                self._fail_finished(f"the engine step failed: {type(e).__name__}: {e}")
                continue
            self._dispatch(events)
        self._apply_aborts()
        self._fail_finished("the server is shutting down", everyone=True)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        self.metrics.generated_tokens.inc(sum(1 for e in events if e.token_id is not None))
        with self._guard:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                if event.error is not None:  # the model raised in this request's step
                    del self._streams[event.request_id]
                    self.llm.pop(event.request_id)
                    self.metrics.finished.labels("error").inc()
                    stream.put(EngineFailure(f"the engine step failed: {event.error}"))
                    continue
                if stream.last is None:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last)
                stream.last = now
                stream.put(event)
                if event.finish_reason is not None:
                    del self._streams[event.request_id]
                    self.llm.pop(event.request_id)
                    self.metrics.finished.labels(event.finish_reason).inc()

    def _apply_aborts(self) -> None:
        while self._aborts:
            request_id, reason = self._aborts.popleft()
            with self._guard:
                if self._streams.pop(request_id, None) is not None:
                    self.llm.pop(request_id)
                    self.metrics.finished.labels(reason).inc()

    def _fail_finished(self, message: str, everyone: bool = False) -> None:
        """End the streams of requests the engine finished without a last token (all with ``everyone``)."""
        with self._guard:
            for request_id, stream in list(self._streams.items()):
                if everyone or self.llm.completion(request_id).finish_reason is not None:
                    del self._streams[request_id]
                    self.llm.pop(request_id)
                    self.metrics.finished.labels("error").inc()
                    stream.put(EngineFailure(message))
