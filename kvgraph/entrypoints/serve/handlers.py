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
    echo = await _echo(s, body) if body.echo else None
    gen = await _start(
        s, body, echo.ids if echo else body.prompt, max(body.max_tokens, 1),
        prompt_logprobs=body.logprobs if echo else None,
    )
    rid = f"cmpl-{uuid.uuid4().hex}"
    logprobs = _renderer(s, body)
    if body.stream:
        return _sse(_completion_chunks(gen, rid, s.model_name, body.include_usage, logprobs, echo))
    whole = await _whole(gen)
    choice = echo.choice(whole, logprobs) if echo else _completion_choice(whole, logprobs)
    return CompletionResponse(id=rid, model=s.model_name, choices=[choice], usage=_usage(gen, echo))


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


@dataclass
class _Echo:
    """An echoed prompt (``echo: true``): its ids, its text, and the tokens asked for (``0``: the
    prompt alone; one token is still generated, as the engine generates at least one, and dropped)."""

    ids: list[int]
    text: str
    max_tokens: int

    def prompt_choice(self, piece: Piece, logprobs: LogprobsRenderer | None) -> CompletionChoice:
        """The prompt's text and log-probabilities (scored on ``piece``'s first token); the text
        offsets of later tokens start after it. Finished (``"length"``) when nothing else is asked."""
        scores = piece.events[0].prompt_logprobs if piece.events else None
        shown = logprobs.prompt(self.ids, scores) if logprobs else None
        if logprobs:
            logprobs.offset = len(self.text)
        return CompletionChoice(text=self.text, logprobs=shown, finish_reason=None if self.max_tokens else "length")

    def choice(self, piece: Piece, logprobs: LogprobsRenderer | None) -> CompletionChoice:
        """The whole answer: the prompt's choice, then ``piece``'s text and tokens."""
        first = self.prompt_choice(piece, logprobs)
        if not self.max_tokens:
            return first
        rest = _completion_choice(piece, logprobs)
        first.text += rest.text
        first.finish_reason = rest.finish_reason
        if first.logprobs is not None:
            first.logprobs.extend(rest.logprobs)
        return first


async def _echo(s: ServeState, body: CompletionRequest) -> _Echo:
    """The prompt's ids (checked as the engine checks them) and its text."""
    ids = await asyncio.to_thread(s.llm.encode, body.prompt)
    if isinstance(body.prompt, str):
        text = body.prompt
    else:
        text = "" if s.llm.tokenizer is None else await asyncio.to_thread(s.llm.tokenizer.decode, ids)
    return _Echo(ids, text, body.max_tokens)


# -- shared steps --
async def _start(
    s: ServeState, body: GenerationFields, prompt: Prompt, max_tokens: int, prompt_logprobs: int | None = None,
) -> Generation:
    """Check the model name and queue the request (``KVCacheError`` for a prompt the engine refuses)."""
    _check_model(s, body.model)
    sampling = SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        seed=body.seed, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias, min_tokens=body.min_tokens, logprobs=body.num_logprobs,
        prompt_logprobs=prompt_logprobs,
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


def _usage(gen: Generation, echo: _Echo | None = None) -> Usage:
    """Tokens of the prompt and generated ones (none for an echo of the prompt alone)."""
    return Usage.of(gen.handle.prompt_tokens, gen.num_tokens if echo is None or echo.max_tokens else 0)


def _sse(chunks: AsyncIterator) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _completion_chunks(
    gen: Generation, rid: str, model: str, usage: bool, logprobs: LogprobsRenderer | None, echo: _Echo | None,
) -> AsyncIterator[CompletionResponse]:
    prompt_first = echo
    async for piece in gen.pieces():
        if prompt_first is not None:
            yield CompletionResponse(id=rid, model=model, choices=[prompt_first.prompt_choice(piece, logprobs)])
            if not prompt_first.max_tokens:
                break
            prompt_first = None
        yield CompletionResponse(id=rid, model=model, choices=[_completion_choice(piece, logprobs)])
    if usage:
        yield CompletionResponse(id=rid, model=model, choices=[], usage=_usage(gen, echo))


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
