"""``AsyncEngine``: one ``kvgraph.LLM`` behind an async bridge in the server's own process
(``kvgraph serve --no-frontend-process``), so the event loop never runs a step.

One engine thread owns the stepping: before each step it queues every request that arrived
(``submit`` tokenizes and checks a prompt at once, then leaves it in an inbox) and applies the
aborts; then it calls ``LLM.step()`` and hands the step's tokens to the event loop in one callback,
which puts each on the asyncio queue of its request (``streams``). Idle, it sleeps until a request arrives.

Arrivals go through the inbox rather than through ``LLM.add_request`` from other threads because
the engine thread takes the engine lock again as soon as a step ends: a thread waiting for it got
in only now and then, so requests sent together joined the batch one step apart, and the last of
32 streams started 30 steps after the first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass

from kvgraph.engine import SamplingParams
from kvgraph.engine.prompts import Prompt
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.metrics import ServeMetrics
from kvgraph.entrypoints.serve.streams import RequestHandle, Stream, StreamTable, post
from kvgraph.errors import EngineFailure

log = logging.getLogger("kvgraph.serve")


@dataclass
class _Arrival:
    """A checked request waiting in the inbox; ``queued`` gets its request id once it is queued."""

    ids: list[int]
    sampling: SamplingParams
    stream: Stream
    queued: asyncio.Future


class AsyncEngine:
    """Drives ``llm`` from one engine thread; ``submit`` and ``abort`` are for the event loop.

    ``checks``: what the handlers check and tokenize requests with; ``metrics``: the server's
    metrics, the engine's figures read from ``llm``; ``pid``: the engine's process (this one);
    ``exit_reason``: ``None`` (as for ``EngineClient``: the engine thread never ends unasked);
    ``stream_interval``: the tokens each stream hands on together (``StreamTable``).
    """

    def __init__(self, llm: LLM, stream_interval: int = 1) -> None:
        self.llm = llm
        self.checks = llm.request_checks()
        self.pid = os.getpid()
        self.metrics = ServeMetrics(llm.stats, self.pid)
        self.exit_reason: str | None = None
        self._streams = StreamTable(self.metrics, stream_interval)  # touched by the engine thread only
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
            ids = await loop.run_in_executor(None, self.checks.encode, prompt, sampling)
        else:
            ids = self.checks.encode(prompt, sampling)
        if self._stopping:
            raise EngineFailure("the server is shutting down")
        stream = Stream(loop)
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
            for request_id in self._streams.dispatch(events):
                self.llm.pop(request_id)
        self._apply_aborts()
        self._fail_finished("the server is shutting down", everyone=True)
        self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        while self._inbox:
            arrival = self._inbox.popleft()
            post(arrival.stream.loop, _refuse, arrival.queued, EngineFailure("the server is shutting down"))

    def _admit(self) -> None:
        """Queue every request in the inbox, so those sent together start in the same step."""
        while self._inbox:
            arrival = self._inbox.popleft()
            try:
                request_id = self.llm.add_request(arrival.ids, arrival.sampling)
            except Exception as e:  # checked already; still, the caller gets the error, not a hang
                post(arrival.stream.loop, _refuse, arrival.queued, e)
                continue
            self._streams.add(request_id, arrival.stream)
            post(arrival.stream.loop, self._admitted, arrival.queued, request_id)

    def _admitted(self, queued: asyncio.Future, request_id: int) -> None:
        """(On the event loop) hand ``submit`` its request id, or abort it if ``submit`` was cancelled."""
        if queued.cancelled():
            self.abort(request_id)
        else:
            queued.set_result(request_id)

    def _apply_aborts(self) -> None:
        while self._aborts:
            request_id, reason = self._aborts.popleft()
            if self._streams.drop(request_id, reason):
                self.llm.pop(request_id)

    def _fail_finished(self, message: str, everyone: bool = False) -> None:
        """End the streams of requests the engine finished without a last token (all with ``everyone``)."""
        ids = [i for i in self._streams.ids() if everyone or self.llm.completion(i).finish_reason is not None]
        for request_id in self._streams.fail(ids, message):
            self.llm.pop(request_id)


def _refuse(queued: asyncio.Future, error: Exception) -> None:
    if not queued.cancelled():
        queued.set_exception(error)
