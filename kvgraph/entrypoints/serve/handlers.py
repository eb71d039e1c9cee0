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
from kvgraph.engine.prompts import Prompt, check_token_ids
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.chat import chat_prompt
from kvgraph.entrypoints.serve.errors import APIError, engine_failure, model_not_found
from kvgraph.entrypoints.serve.logprobs import LogprobsRenderer
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
    DetokenizeRequest,
    DetokenizeResponse,
    GenerationFields,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from kvgraph.entrypoints.serve.stop import StopStrings
from kvgraph.entrypoints.serve.streaming import Generation, Piece, server_sent_events
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
    logprobs = _renderer(s, body)
    if body.stream:
        return _sse(_completion_chunks(gen, rid, s.model_name, body.include_usage, logprobs))
    whole = await _whole(gen)
    return CompletionResponse(
        id=rid, model=s.model_name, choices=[_completion_choice(whole, logprobs)], usage=_usage(gen)
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, s: State) -> Response | ChatCompletionResponse:
    prompt = chat_prompt(s.llm.tokenizer, body.messages)
    gen = await _start(s, body, prompt, body.max_tokens or s.llm.max_seq_len)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    logprobs = _renderer(s, body)
    if body.stream:
        return _sse(_chat_chunks(gen, rid, s.model_name, body.include_usage, logprobs))
    whole = await _whole(gen)
    choice = ChatChoice(message=AssistantMessage(content=whole.text), finish_reason=whole.finish_reason,
                        logprobs=logprobs.chat(whole.events) if logprobs else None)
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=[choice], usage=_usage(gen))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: State) -> TokenizeResponse:
    """vLLM's: a prompt's (or chat messages') token ids, counted against ``max_model_len``."""
    tokenizer = _tokenizer(s, body.model)
    if body.messages is not None:
        ids = await asyncio.to_thread(chat_prompt, tokenizer, body.messages, body.add_generation_prompt,
                                      bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=add_special))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=s.llm.max_seq_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: State) -> DetokenizeResponse:
    """vLLM's: token ids back to text (``RequestError``, a 400, for an id outside the vocabulary)."""
    tokenizer = _tokenizer(s, body.model)
    check_token_ids(body.tokens, s.llm.vocab_size)
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


# -- shared steps --
async def _start(s: ServeState, body: GenerationFields, prompt: Prompt, max_tokens: int) -> Generation:
    """Check the model name and queue the request (``KVCacheError`` for a prompt the engine refuses)."""
    _check_model(s, body.model)
    sampling = SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        seed=body.seed, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias, min_tokens=body.min_tokens, logprobs=body.num_logprobs,
    )
    handle = await s.engine.submit(prompt, sampling)
    return Generation(handle, StopStrings(body.stop), min_tokens=body.min_tokens)


def _check_model(s: ServeState, model: str | None) -> None:
    if model is not None and model != s.model_name:
        raise model_not_found(model, s.model_name)


def _tokenizer(s: ServeState, model: str | None) -> object:
    _check_model(s, model)
    if s.llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot tokenize or detokenize")
    return s.llm.tokenizer


def _renderer(s: ServeState, body: GenerationFields) -> LogprobsRenderer | None:
    """The request's log-probabilities renderer, ``None`` when it asked for none."""
    return LogprobsRenderer(s.llm.tokenizer) if body.num_logprobs is not None else None


async def _whole(gen: Generation) -> Piece:
    try:
        return await gen.whole()
    except EngineFailure as e:
        raise engine_failure(str(e)) from e


def _completion_choice(piece: Piece, logprobs: LogprobsRenderer | None) -> CompletionChoice:
    return CompletionChoice(text=piece.text, finish_reason=piece.finish_reason,
                            logprobs=logprobs.completion(piece.events) if logprobs else None)


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.handle.prompt_tokens, gen.num_tokens)


def _sse(chunks: AsyncIterator) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _completion_chunks(
    gen: Generation, rid: str, model: str, usage: bool, logprobs: LogprobsRenderer | None
) -> AsyncIterator[CompletionResponse]:
    async for piece in gen.pieces():
        yield CompletionResponse(id=rid, model=model, choices=[_completion_choice(piece, logprobs)])
    if usage:
        yield CompletionResponse(id=rid, model=model, choices=[], usage=_usage(gen))


async def _chat_chunks(
    gen: Generation, rid: str, model: str, usage: bool, logprobs: LogprobsRenderer | None
) -> AsyncIterator[ChatCompletionChunk]:
    yield ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    async for piece in gen.pieces():
        delta = ChatDelta(content=piece.text) if piece.text else ChatDelta()
        choice = ChatChunkChoice(delta=delta, finish_reason=piece.finish_reason,
                                 logprobs=logprobs.chat(piece.events) if logprobs else None)
        yield ChatCompletionChunk(id=rid, model=model, choices=[choice])
    if usage:
        yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage(gen))
