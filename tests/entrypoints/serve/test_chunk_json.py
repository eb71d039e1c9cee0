"""Text chunks written as JSON directly: byte for byte what pydantic writes for the same chunk."""

from __future__ import annotations

import json

import pytest

from kvgraph.entrypoints.serve.chunk_json import ChatChunkJSON, CompletionChunkJSON
from kvgraph.entrypoints.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

TEXTS = [
    "", "hello", " world\n", 'quote " and \\ backslash', "tab\tcr\rff\fbs\b", "\x00\x01\x1f\x7f",
    "héllo wörld ✓ 日本語", "🙂🙃", "\u2028\u2029", "\ufffd", "</script>", "a" * 300,
    "".join(chr(c) for c in range(0, 0x250)),
]
FINISH = [None, "stop", "length", "abort"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", FINISH)
def test_completion_chunk_is_what_pydantic_writes(text, finish_reason):
    render = CompletionChunkJSON("cmpl-1", "llama-tiny", created=1_700_000_000)
    for index in (0, 3):
        expected = CompletionResponse(
            id="cmpl-1", model="llama-tiny", created=1_700_000_000,
            choices=[CompletionChoice(index=index, text=text, finish_reason=finish_reason)],
        ).model_dump_json()
        assert render(index, text, finish_reason) == expected
        assert json.loads(render(index, text, finish_reason))["choices"][0]["text"] == text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", FINISH)
def test_chat_chunk_is_what_pydantic_writes(text, finish_reason):
    render = ChatChunkJSON("chatcmpl-1", "llama-tiny", created=1_700_000_000)
    for index in (0, 2):
        delta = ChatDelta(content=text) if text else ChatDelta()
        expected = ChatCompletionChunk(
            id="chatcmpl-1", model="llama-tiny", created=1_700_000_000,
            choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)],
        ).model_dump_json()
        assert render(index, text, finish_reason) == expected


def test_chunks_of_one_response_share_its_id_model_and_created():
    render = CompletionChunkJSON("cmpl-7", "m", created=123)
    a, b = json.loads(render(0, "a", None)), json.loads(render(0, "b", "stop"))
    assert (a["id"], a["model"], a["created"], a["object"]) == (b["id"], b["model"], b["created"], b["object"])
    assert (a["id"], a["model"], a["created"], a["object"]) == ("cmpl-7", "m", 123, "text_completion")
    assert a["usage"] is None and a["choices"][0]["logprobs"] is None
