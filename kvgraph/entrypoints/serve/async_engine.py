"""``AsyncEngine``: one ``kvgraph.LLM`` behind an async bridge, so the event loop never runs a step.

One engine thread owns the stepping: before each step it queues every request that arrived
(``submit`` tokenizes and checks a prompt at once, then leaves it in an inbox) and applies the
aborts; then it calls ``LLM.step()`` and hands the step's tokens to the event loop in one callback,
which puts each on the asyncio queue of its request. Idle, it sleeps until a request arrives.

Arrivals go through the inbox rather than through ``LLM.add_request`` from other threads because
the engine thread takes the engine lock again as soon as a step ends: a thread waiting for it got
in only now and then, so requests sent together joined the batch one step apart, and the last of
32 streams started 30 steps after the first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvgraph.engine import SamplingParams, TokenEvent
from kvgraph.engine.prompts import Prompt
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.metrics import ServeMetrics
from kvgraph.errors import EngineFailure

log = logging.getLogger("kvgraph.serve")


@dataclass
class _Stream:
    """Where the engine thread puts one request's tokens: ``TokenEvent``s, or an ``EngineFailure``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None


@dataclass
class _Arrival:
    """A checked request waiting in the inbox; ``queued`` gets its request id once it is queued."""

    ids: list[int]
    sampling: SamplingParams
    stream: _Stream
    queued: asyncio.Future


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` (from another thread); nothing if the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _deliver(items: list[tuple[_Stream, TokenEvent | EngineFailure]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class RequestHandle:
    """One queued request: iterate it for its tokens; ``abort()`` if it is left early."""

    def __init__(self, engine: AsyncEngine, request_id: int, prompt_tokens: int, stream: _Stream) -> None:
        self.engine, self.request_id, self.prompt_tokens = engine, request_id, prompt_tokens
        self.stream = stream
        self.finished = False
        self._head: TokenEvent | EngineFailure | None = None  # the first item, once started() waited for it

    async def started(self) -> None:
        """Wait until the request's first token (or its failure) came, without taking it: its prompt
        is then in the cache (and in the prefix cache, for the requests that follow)."""
        if self._head is None and not self.finished:
            self._head = await self.stream.queue.get()

    @property
    def first_event(self) -> TokenEvent | None:
        """The first token's event once :meth:`started` waited for it (``None`` before, or after a failure)."""
        return self._head if isinstance(self._head, TokenEvent) else None

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        """The request's tokens as they come; the last one has a ``finish_reason``. Raises
        ``EngineFailure`` if the engine aborted the request."""
        while not self.finished:
            item, self._head = (self._head, None) if self._head is not None else (await self.stream.queue.get(), None)
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
        self._inbox: deque[_Arrival] = deque()  # checked requests for the engine thread to queue
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvgraph-engine", daemon=True)

    # -- event loop side --
    def start(self) -> None:
        self._thread.start()

    async def submit(self, prompt: Prompt, sampling: SamplingParams) -> RequestHandle:
        """Queue a request before the next step. Raises what ``LLM.add_request`` raises for a bad
        prompt or sampling, at once and queueing nothing."""
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str):  # a tokenizer call can take a while: not on the event loop
            ids = await loop.run_in_executor(None, self.llm.encode, prompt, sampling)
        else:
            ids = self.llm.encode(prompt, sampling)
        if self._stopping:
            raise EngineFailure("the server is shutting down")
        stream = _Stream(loop)
        arrival = _Arrival(ids, sampling, stream, loop.create_future())
        self._inbox.append(arrival)
        self._wake.set()
        # cancelled here (the client left), the request is aborted once queued: see _admitted
        request_id = await arrival.queued
        return RequestHandle(self, request_id, len(ids), stream)

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Have the engine thread abort the request before its next step (returns at once)."""
        self._aborts.append((request_id, reason))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, end the engine thread and wait for it."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._refuse_inbox()  # what arrived as the thread ended

    # -- engine thread --
    def _run(self) -> None:
        while not self._stopping:
            self._apply_aborts()
            self._admit()
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
        self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        while self._inbox:
            arrival = self._inbox.popleft()
            _post(arrival.stream.loop, _refuse, arrival.queued, EngineFailure("the server is shutting down"))

    def _admit(self) -> None:
        """Queue every request in the inbox, so those sent together start in the same step."""
        while self._inbox:
            arrival = self._inbox.popleft()
            try:
                with self._guard:
                    request_id = self.llm.add_request(arrival.ids, arrival.sampling)
                    self._streams[request_id] = arrival.stream
            except Exception as e:  # checked already; still, the caller gets the error, not a hang
                _post(arrival.stream.loop, _refuse, arrival.queued, e)
                continue
            _post(arrival.stream.loop, self._admitted, arrival.queued, request_id)

    def _admitted(self, queued: asyncio.Future, request_id: int) -> None:
        """(On the event loop) hand ``submit`` its request id, or abort it if ``submit`` was cancelled."""
        if queued.cancelled():
            self.abort(request_id)
        else:
            queued.set_result(request_id)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        self.metrics.generated_tokens.inc(sum(1 for e in events if e.token_id is not None))
        out: list[tuple[_Stream, TokenEvent | EngineFailure]] = []
        with self._guard:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                if event.error is not None:  # the model raised in this request's step
                    del self._streams[event.request_id]
                    self.llm.pop(event.request_id)
                    self.metrics.finished.labels("error").inc()
                    out.append((stream, EngineFailure(f"the engine step failed: {event.error}")))
                    continue
                if stream.last is None:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last)
                stream.last = now
                out.append((stream, event))
                if event.finish_reason is not None:
                    del self._streams[event.request_id]
                    self.llm.pop(event.request_id)
                    self.metrics.finished.labels(event.finish_reason).inc()
        self._send(out)

    @staticmethod
    def _send(items: list[tuple[_Stream, TokenEvent | EngineFailure]]) -> None:
        """One event-loop callback per loop for all of ``items``, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            _post(loop, _deliver, batch)

    def _apply_aborts(self) -> None:
        while self._aborts:
            request_id, reason = self._aborts.popleft()
            with self._guard:
                if self._streams.pop(request_id, None) is not None:
                    self.llm.pop(request_id)
                    self.metrics.finished.labels(reason).inc()

    def _fail_finished(self, message: str, everyone: bool = False) -> None:
        """End the streams of requests the engine finished without a last token (all with ``everyone``)."""
        out = []
        with self._guard:
            for request_id, stream in list(self._streams.items()):
                if everyone or self.llm.completion(request_id).finish_reason is not None:
                    del self._streams[request_id]
                    self.llm.pop(request_id)
                    self.metrics.finished.labels("error").inc()
                    out.append((stream, EngineFailure(message)))
        self._send(out)


def _refuse(queued: asyncio.Future, error: Exception) -> None:
    if not queued.cancelled():
        queued.set_exception(error)
