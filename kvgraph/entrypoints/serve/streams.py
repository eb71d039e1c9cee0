"""Where each request's tokens go on the event loop, whichever side runs the engine.

A ``StreamTable`` maps request ids to streams (an asyncio queue each). The side that receives a
step's tokens (the engine thread, or the reader thread of the engine process's client) hands them
to ``dispatch``, which records the latency metrics and puts them on their requests' queues with
one event-loop callback per step. A handler reads a request through its ``RequestHandle``.

With a ``stream_interval`` of N > 1 (``kvgraph serve --stream-interval``, as vLLM's), a stream holds
its tokens back until N have come, and hands them on together: the handler wakes once and writes one
chunk for them. The first token goes at once (the time to first token is kept), and so do the last
one and a failure, after the tokens held before them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvgraph.engine import TokenEvent
from kvgraph.engine.detokenize import IncrementalDetokenizer
from kvgraph.entrypoints.serve.metrics import ServeMetrics
from kvgraph.errors import EngineFailure


@dataclass
class Stream:
    """Where one request's tokens go: ``TokenEvent``s, or an ``EngineFailure``.

    ``detokenizer`` and ``token_ids``: the text of its tokens so far, when the tokens come without
    their text (from the engine process).
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None
    detokenizer: IncrementalDetokenizer | None = None
    token_ids: list[int] = field(default_factory=list)
    held: list[TokenEvent] = field(default_factory=list)  # tokens not handed on yet (``stream_interval``)

    def text(self, token_id: int, final: bool) -> str | None:
        """The text ``token_id`` adds (``None`` without a detokenizer)."""
        if self.detokenizer is None:
            return None
        self.token_ids.append(token_id)
        return self.detokenizer.delta(self.token_ids, final=final)


class Aborts(Protocol):
    def abort(self, request_id: int, reason: str = "abort") -> None: ...


def post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` (from another thread); nothing if the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _deliver(items: list[tuple[Stream, TokenEvent | EngineFailure]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class StreamTable:
    """The requests being streamed, by id; ``lock`` guards the table (taken by every method).
    ``stream_interval``: the tokens a stream hands on together (see the module's docstring)."""

    def __init__(self, metrics: ServeMetrics, stream_interval: int = 1) -> None:
        self.metrics = metrics
        self.stream_interval = self.check_interval(stream_interval)
        self.lock = threading.Lock()
        self._streams: dict[int, Stream] = {}  # request id -> where its tokens go

    @staticmethod
    def check_interval(stream_interval: int) -> int:
        """``stream_interval`` if it is an integer >= 1; else ``ValueError`` naming it."""
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        return stream_interval

    def ids(self) -> list[int]:
        with self.lock:
            return list(self._streams)

    def add(self, request_id: int, stream: Stream) -> None:
        with self.lock:
            self._streams[request_id] = stream

    def drop(self, request_id: int, reason: str | None) -> bool:
        """Forget a request that is left early, counting it as finished for ``reason`` (not at all
        for ``None``: it never reached the engine); whether it was still streaming."""
        with self.lock:
            if self._streams.pop(request_id, None) is None:
                return False
        if reason is not None:
            self.metrics.finished.labels(reason).inc()
        return True

    def texts(self, records: Iterable[tuple]) -> list[TokenEvent]:
        """Events from the engine process's records ``(request id, token id, finish reason, error,
        logprobs, prompt logprobs)``, each with its text; records of requests left early are dropped."""
        events = []
        with self.lock:
            for request_id, token_id, finish_reason, error, logprobs, prompt_logprobs in records:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                text = None if token_id is None else stream.text(token_id, finish_reason is not None)
                events.append(TokenEvent(request_id=request_id, token_id=token_id, text=text,
                                         finish_reason=finish_reason, error=error, logprobs=logprobs,
                                         prompt_logprobs=prompt_logprobs))
        return events

    def dispatch(self, events: list[TokenEvent]) -> list[int]:
        """Hand a step's ``events`` to their streams (one event-loop callback per loop), recording
        the latencies; returns the requests that ended (finished, or failed in the model)."""
        now = time.perf_counter()
        self.metrics.generated_tokens.inc(sum(1 for e in events if e.token_id is not None))
        out: list[tuple[Stream, TokenEvent | EngineFailure]] = []
        ended = []
        with self.lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                if event.error is not None:  # the model raised in this request's step
                    del self._streams[event.request_id]
                    ended.append(event.request_id)
                    self.metrics.finished.labels("error").inc()
                    _release(stream, out)
                    out.append((stream, EngineFailure(f"the engine step failed: {event.error}")))
                    continue
                first = stream.last is None
                if first:
                    self.metrics.ttft.observe(now - stream.arrival)
                else:
                    self.metrics.itl.observe(now - stream.last)
                stream.last = now
                stream.held.append(event)
                if first or event.finish_reason is not None or len(stream.held) >= self.stream_interval:
                    _release(stream, out)
                if event.finish_reason is not None:
                    del self._streams[event.request_id]
                    ended.append(event.request_id)
                    self.metrics.finished.labels(event.finish_reason).inc()
        _send(out)
        return ended

    def fail(self, request_ids: Iterable[int] | None, message: str) -> list[int]:
        """End the streams of ``request_ids`` (all with ``None``) with an ``EngineFailure``; returns
        those that were still streaming."""
        out, ended = [], []
        with self.lock:
            for request_id in list(self._streams) if request_ids is None else request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    ended.append(request_id)
                    _release(stream, out)
                    out.append((stream, EngineFailure(message)))
        for _ in ended:
            self.metrics.finished.labels("error").inc()
        _send(out)
        return ended


def _release(stream: Stream, out: list[tuple[Stream, TokenEvent | EngineFailure]]) -> None:
    """Move the tokens ``stream`` holds to ``out``, in order."""
    out.extend((stream, event) for event in stream.held)
    stream.held.clear()


def _send(items: list[tuple[Stream, TokenEvent | EngineFailure]]) -> None:
    """One event-loop callback per loop for all of ``items``, not one per token."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        post(loop, _deliver, batch)


class RequestHandle:
    """One queued request: iterate it for its tokens; ``abort()`` if it is left early."""

    def __init__(self, engine: Aborts, request_id: int, prompt_tokens: int, stream: Stream) -> None:
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
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[TokenEvent]]:
        """The request's tokens as they come, each batch every token that had come when it was
        taken: a reader that falls behind the engine catches up by a batch per step, not a token.
        A failure is raised once the tokens before it were handed out."""
        while not self.finished:
            item, self._head = (self._head, None) if self._head is not None else (await self.stream.queue.get(), None)
            batch: list[TokenEvent] = []
            while True:
                if isinstance(item, EngineFailure):
                    if batch:  # raised on the next call
                        self._head = item
                        break
                    self.finished = True
                    raise item
                batch.append(item)
                if item.finish_reason is not None:
                    self.finished = True
                    break
                if self.stream.queue.empty():
                    break
                item = self.stream.queue.get_nowait()
            yield batch

    def abort(self, reason: str = "abort") -> None:
        """Stop the request (no-op once finished); returns at once, the pages are freed before the
        next step. ``reason`` is what the metrics count it as ("stop" for a stop string)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id, reason)
