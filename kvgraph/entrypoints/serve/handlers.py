"""One thin handler per endpoint: check the request, hand it to the engine, shape the answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvgraph.engine import SamplingParams
from kvgraph.engine.prompts import Prompt
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.chat import chat_prompt
from kvgraph.entrypoints.serve.errors import engine_failure, model_not_found
from kvgraph.entrypoints.serve.metrics import ServeMetrics
from kvgraph.entrypoints.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerationFields,
    ModelCard,
    ModelList,
    Usage,
)
from kvgraph.entrypoints.serve.stop import StopStrings
from kvgraph.entrypoints.serve.streaming import Generation, server_sent_events
from kvgraph.errors import EngineFailure

router = APIRouter()


@dataclass
class ServeState:
    """What the handlers share: the engine, its metrics and the name it is served under."""

    llm: LLM
    engine: AsyncEngine
    metrics: ServeMetrics
    model_name: str


def _state(request: Request) -> ServeState:
    return request.app.state.serve


State = Annotated[ServeState, Depends(_state)]


@router.get("/health")
async def health() -> JSONResponse:
    """200 once the model is compiled and warm (the server only listens from then on)."""
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(s: State) -> ModelList:
    return ModelList(data=[ModelCard(id=s.model_name, max_model_len=s.llm.max_seq_len)])


@router.get("/metrics")
async def metrics(s: State) -> Response:
    body = await asyncio.to_thread(s.metrics.render)  # reads LLM.stats(), which waits for the step in flight
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, s: State) -> Response | CompletionResponse:
    gen = await _start(s, body, body.prompt, body.max_tokens)
    rid = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return _sse(_completion_chunks(gen, rid, s.model_name, body.include_usage))
    text, reason = await _whole(gen)
    return CompletionResponse(
        id=rid, model=s.model_name, choices=[CompletionChoice(text=text, finish_reason=reason)], usage=_usage(gen)
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, s: State) -> Response | ChatCompletionResponse:
    prompt = chat_prompt(s.llm.tokenizer, body.messages)
    gen = await _start(s, body, prompt, body.max_tokens or s.llm.max_seq_len)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return _sse(_chat_chunks(gen, rid, s.model_name, body.include_usage))
    text, reason = await _whole(gen)
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason)
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=[choice], usage=_usage(gen))


# -- shared steps --
async def _start(s: ServeState, body: GenerationFields, prompt: Prompt, max_tokens: int) -> Generation:
    """Check the model name and queue the request (``KVCacheError`` for a prompt the engine refuses)."""
    if body.model != s.model_name:
        raise model_not_found(body.model, s.model_name)
    sampling = SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        seed=body.seed, ignore_eos=body.ignore_eos,
    )
    handle = await s.engine.submit(prompt, sampling)
    return Generation(handle, StopStrings(body.stop))


async def _whole(gen: Generation) -> tuple[str, str | None]:
    try:
        return await gen.text()
    except EngineFailure as e:
        raise engine_failure(str(e)) from e


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.handle.prompt_tokens, gen.num_tokens)


def _sse(chunks: AsyncIterator) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _completion_chunks(gen: Generation, rid: str, model: str, usage: bool) -> AsyncIterator[CompletionResponse]:
    async for piece in gen.pieces():
        yield CompletionResponse(
            id=rid, model=model, choices=[CompletionChoice(text=piece.text, finish_reason=piece.finish_reason)]
        )
    if usage:
        yield CompletionResponse(id=rid, model=model, choices=[], usage=_usage(gen))


async def _chat_chunks(gen: Generation, rid: str, model: str, usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    async for piece in gen.pieces():
        delta = ChatDelta(content=piece.text) if piece.text else ChatDelta()
        yield ChatCompletionChunk(
            id=rid, model=model, choices=[ChatChunkChoice(delta=delta, finish_reason=piece.finish_reason)]
        )
    if usage:
        yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(gen))
