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
