"""From a request's tokens to what the client gets: text pieces cut at stop strings, and
server-sent events as the OpenAI clients read them (``data: {json}`` blocks, then ``data: [DONE]``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from kvgraph.engine import TokenEvent
from kvgraph.entrypoints.serve.errors import error_body
from kvgraph.entrypoints.serve.stop import StopStrings
from kvgraph.entrypoints.serve.streams import RequestHandle
from kvgraph.errors import EngineFailure


@dataclass
class Piece:
    """Text to send, and the tokens read since the previous piece (for their log-probabilities);
    the last piece of a request carries its ``finish_reason``."""

    text: str
    finish_reason: str | None = None
    events: list[TokenEvent] = field(default_factory=list)


@dataclass
class Generation:
    """One request's output as it is read: ``num_tokens`` generated so far; the text of the first
    ``min_tokens`` is not searched for stop strings (as the EOS, they cannot end it there)."""

    handle: RequestHandle
    stops: StopStrings
    min_tokens: int = 0
    num_tokens: int = 0

    async def pieces(self) -> AsyncIterator[Piece]:
        """The text as it comes, ending at the first stop string (``finish_reason="stop"``, the
        request aborted there) or at the engine's finish reason. The tokens that came since the
        last piece make one piece (one SSE chunk): a client that reads slower than the engine
        steps gets fewer, longer chunks. Leaving early aborts the request."""
        events: list[TokenEvent] = []
        try:
            async for batch in self.handle.batches():
                text = ""
                for event in batch:
                    self.num_tokens += 1
                    events.append(event)
                    new, stopped = self.stops.feed(event.text or "", armed=self.num_tokens > self.min_tokens)
                    text += new
                    if stopped:
                        self.handle.abort("stop")
                        yield Piece(text, "stop", events)
                        return
                    if event.finish_reason is not None:
                        yield Piece(text + self.stops.flush(), event.finish_reason, events)
                        return
                if text:
                    yield Piece(text, events=events)
                    events = []
        finally:
            self.handle.abort()

    async def whole(self) -> Piece:
        """The whole text, the finish reason and every token."""
        whole = Piece("")
        async for piece in self.pieces():
            whole.text += piece.text
            whole.finish_reason = piece.finish_reason
            whole.events += piece.events
        return whole


async def server_sent_events(chunks: AsyncIterator[BaseModel | str]) -> AsyncIterator[str]:
    """Each chunk (a model, or its JSON already) as an SSE ``data:`` block, an engine failure as an
    error block, then ``[DONE]``."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk if isinstance(chunk, str) else chunk.model_dump_json()}\n\n"
    except EngineFailure as e:
        yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
    yield "data: [DONE]\n\n"
