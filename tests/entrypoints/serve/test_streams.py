"""A request's stream hands a slow reader every token that came as one batch, then its failure."""

from __future__ import annotations

import asyncio

import pytest

from kvgraph.engine import TokenEvent
from kvgraph.entrypoints.serve.stop import StopStrings
from kvgraph.entrypoints.serve.streaming import Generation
from kvgraph.entrypoints.serve.streams import RequestHandle, Stream
from kvgraph.errors import EngineFailure


class Aborts:
    def __init__(self) -> None:
        self.aborted: list[tuple[int, str]] = []

    def abort(self, request_id: int, reason: str = "abort") -> None:
        self.aborted.append((request_id, reason))


def _event(token: int, text: str, finish_reason: str | None = None) -> TokenEvent:
    return TokenEvent(request_id=0, token_id=token, text=text, finish_reason=finish_reason)


def _handle(*items: TokenEvent | EngineFailure) -> tuple[RequestHandle, Aborts]:
    stream = Stream(asyncio.get_running_loop())
    for item in items:
        stream.queue.put_nowait(item)
    engine = Aborts()
    return RequestHandle(engine, 0, 3, stream), engine


def test_tokens_that_came_together_are_one_batch_and_a_failure_follows_them():
    async def scenario():
        handle, _ = _handle(_event(1, "a"), _event(2, "b"), EngineFailure("the engine process exited"))
        batches = []
        with pytest.raises(EngineFailure, match="engine process exited"):
            async for batch in handle.batches():
                batches.append([e.token_id for e in batch])
        return batches, handle.finished

    assert asyncio.run(scenario()) == ([[1, 2]], True)


def test_a_batch_ends_at_the_last_token():
    async def scenario():
        handle, engine = _handle(_event(1, "a"), _event(2, "b", "length"))
        batches = [[e.token_id for e in batch] async for batch in handle.batches()]
        handle.abort()
        return batches, engine.aborted

    assert asyncio.run(scenario()) == ([[1, 2]], [])


def test_a_piece_of_several_tokens_stops_at_a_stop_string_inside_it():
    async def scenario():
        handle, engine = _handle(_event(1, "ab"), _event(2, "cX"), _event(3, "Yd"), _event(4, "e"))
        gen = Generation(handle, StopStrings(["XY"]))
        pieces = [(p.text, p.finish_reason, [e.token_id for e in p.events]) async for p in gen.pieces()]
        return pieces, gen.num_tokens, engine.aborted

    pieces, tokens, aborted = asyncio.run(scenario())
    assert pieces == [("abc", "stop", [1, 2, 3])]
    assert tokens == 3 and aborted == [(0, "stop")]


# -- a stream interval: tokens handed on N at a time --

def _table_scenario(interval: int, steps: list[list[TokenEvent]], failure_after: int | None = None):
    """Each step's events through a ``StreamTable`` of ``interval``; what the request's queue held
    after each step (token ids, or "failure"), and the counts of the TTFT and ITL histograms."""
    from kvgraph.entrypoints.serve.metrics import ServeMetrics
    from kvgraph.entrypoints.serve.streams import StreamTable

    async def scenario():
        table = StreamTable(ServeMetrics(dict, 0), stream_interval=interval)
        stream = Stream(asyncio.get_running_loop())
        table.add(0, stream)
        seen = []
        for i, events in enumerate(steps):
            table.dispatch(events)
            if failure_after == i:
                table.fail([0], "the engine process exited")
            await asyncio.sleep(0)  # the delivery callback runs
            got = []
            while not stream.queue.empty():
                item = stream.queue.get_nowait()
                got.append("failure" if isinstance(item, EngineFailure) else item.token_id)
            seen.append(got)
        counts = [[s.value for s in h.collect()[0].samples if s.name.endswith("_count")]
                  for h in (table.metrics.ttft, table.metrics.itl)]
        return seen, *counts

    return asyncio.run(scenario())


def test_an_interval_sends_the_first_token_at_once_then_n_at_a_time_and_the_last_at_once():
    steps = [[_event(t, "x", "length" if t == 8 else None)] for t in range(1, 9)]
    seen, ttft, itl = _table_scenario(3, steps)
    assert seen == [[1], [], [], [2, 3, 4], [], [], [5, 6, 7], [8]]
    assert ttft == [1] and itl == [7]  # every token counted as it came from the engine


def test_an_interval_of_one_sends_every_token_as_it_comes():
    steps = [[_event(t, "x", "stop" if t == 3 else None)] for t in range(1, 4)]
    assert _table_scenario(1, steps)[0] == [[1], [2], [3]]


def test_a_failure_comes_after_the_tokens_held_before_it():
    steps = [[_event(t, "x")] for t in range(1, 4)]
    seen, *_ = _table_scenario(4, steps, failure_after=2)
    assert seen == [[1], [], [2, 3, "failure"]]


def test_a_failed_step_hands_on_the_held_tokens_then_its_error():
    steps = [[_event(1, "x")], [_event(2, "x")],
             [TokenEvent(request_id=0, token_id=None, text=None, finish_reason="error", error="RuntimeError: boom")]]
    assert _table_scenario(5, steps)[0] == [[1], [], [2, "failure"]]


@pytest.mark.parametrize("interval", [0, -2, 1.5, True, "4"])
def test_a_bad_interval_is_refused_naming_it(interval):
    from kvgraph.entrypoints.serve.metrics import ServeMetrics
    from kvgraph.entrypoints.serve.streams import StreamTable

    with pytest.raises(ValueError, match=rf"stream_interval must be an integer >= 1, got {interval!r}"):
        StreamTable(ServeMetrics(dict, 0), stream_interval=interval)
