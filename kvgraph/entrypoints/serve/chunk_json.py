"""The JSON of a streamed response's text chunks, written without a pydantic model per chunk.

Most chunks of a stream carry a piece of text and nothing else: no log-probabilities, no usage.
Building a ``CompletionResponse`` (or ``ChatCompletionChunk``) and its choice for each, then
``model_dump_json``, took about 15 us a chunk under cProfile (a ``benchmarks/serving.py`` load);
the front end spends 80-95 us of CPU per chunk in all. Here pydantic dumps one chunk of the
response once; each text chunk is that dict with its choice's index, finish reason and text put
in, written by ``json.dumps`` with pydantic's separators and UTF-8 as it is: the same bytes as
``model_dump_json`` would write (``tests/entrypoints/serve/test_chunk_json.py``). Every chunk of a
response carries the same ``created``, as OpenAI's do.
"""

from __future__ import annotations

import json

from kvgraph.entrypoints.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)


def _dumps(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class CompletionChunkJSON:
    """A ``/v1/completions`` stream's text chunks (choices without log-probabilities)."""

    def __init__(self, rid: str, model: str, created: int) -> None:
        proto = CompletionResponse(id=rid, model=model, created=created, choices=[CompletionChoice(text="")])
        self._head = proto.model_dump(mode="json")
        self._choice = self._head["choices"][0]

    def __call__(self, index: int, text: str, finish_reason: str | None) -> str:
        choice = {**self._choice, "index": index, "finish_reason": finish_reason, "text": text}
        return _dumps({**self._head, "choices": [choice]})


class ChatChunkJSON:
    """A ``/v1/chat/completions`` stream's content chunks (choices without log-probabilities); a
    chunk with no text has an empty delta, as ``ChatDelta()``."""

    def __init__(self, rid: str, model: str, created: int) -> None:
        proto = ChatCompletionChunk(id=rid, model=model, created=created, choices=[ChatChunkChoice(delta=ChatDelta())])
        self._head = proto.model_dump(mode="json")
        self._choice = self._head["choices"][0]
        self._delta = self._choice["delta"]

    def __call__(self, index: int, text: str, finish_reason: str | None) -> str:
        delta = {**self._delta, "content": text or None}
        choice = {**self._choice, "index": index, "finish_reason": finish_reason, "delta": delta}
        return _dumps({**self._head, "choices": [choice]})
