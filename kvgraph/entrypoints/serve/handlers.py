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
from kvgraph.engine.prompts import Prompt, RequestChecks, check_token_ids
from kvgraph.entrypoints.serve.async_engine import AsyncEngine
from kvgraph.entrypoints.serve.chat import chat_prompt
from kvgraph.entrypoints.serve.choices import PromptEcho, best_first, completion_choice, prompt_echo
from kvgraph.entrypoints.serve.chunk_json import ChatChunkJSON, CompletionChunkJSON
from kvgraph.entrypoints.serve.disconnect import cancel_on_disconnect
from kvgraph.entrypoints.serve.engine_client import EngineClient
from kvgraph.entrypoints.serve.errors import (
    APIError,
    engine_failure,
    engine_unavailable,
    model_not_found,
)
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
    unix_time,
)
from kvgraph.entrypoints.serve.samples import Samples, start_prompts, start_samples
from kvgraph.entrypoints.serve.stop import StopStrings
from kvgraph.entrypoints.serve.streaming import Generation, Piece, server_sent_events
from kvgraph.errors import EngineFailure

router = APIRouter()


@dataclass
class ServeState:
    """What the handlers share: the engine, its request checks (and tokenizer), its metrics and the
    name it is served under."""

    engine: AsyncEngine | EngineClient
    checks: RequestChecks
    metrics: ServeMetrics
    model_name: str


async def _state(request: Request) -> ServeState:
    # async: FastAPI runs a plain function dependency in its thread pool, a thread hop per request
    return request.app.state.serve


State = Annotated[ServeState, Depends(_state)]


@router.get("/health")
async def health(s: State) -> JSONResponse:
    """200 once the model is compiled and warm (the server only listens from then on); 503 with an
    error body once the engine process has died."""
    if s.engine.exit_reason is not None:
        raise engine_unavailable(s.engine.exit_reason)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(s: State) -> ModelList:
    return ModelList(data=[ModelCard(id=s.model_name, max_model_len=s.checks.max_seq_len)])


@router.get("/metrics")
async def metrics(s: State) -> Response:
    body = await asyncio.to_thread(s.metrics.render)  # LLM.stats() waits for the step in flight
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions", response_model=None)
@cancel_on_disconnect
async def completions(body: CompletionRequest, s: State, request: Request) -> Response | CompletionResponse:
    prompts = body.prompts
    # every prompt is checked (and tokenized) before any is queued, so a bad one queues nothing
    if body.echo:
        echoes = [await prompt_echo(s.checks, prompt, body.max_tokens) for prompt in prompts]
        prompts = [echo.ids for echo in echoes]
    else:
        echoes = None
        if len(prompts) > 1:
            prompts = await asyncio.to_thread(_encode_all, s.checks, prompts)
    best_of = body.best_of or body.n
    # best_of > n ranks the samples by their tokens' log-probabilities: every sample reports them
    logprobs = body.logprobs if best_of == body.n else (body.logprobs or 0)

    async def start_prompt(p: int) -> Samples:
        async def start(i: int) -> Generation:
            return await _start(s, body, prompts[p], max(body.max_tokens, 1),
                                prompt_logprobs=body.logprobs if echoes and i == 0 else None, seed=_seed(body, i),
                                logprobs=logprobs)

        samples = await start_samples(best_of, start)
        if echoes is not None:
            try:
                await echoes[p].take_scores(samples.gens[0].handle)
            except BaseException:
                samples.abort()
                raise
        return samples

    samples = await start_prompts(len(prompts), start_prompt)
    rid = f"cmpl-{uuid.uuid4().hex}"
    renderers = [_renderer(s, body) for _ in samples.gens]
    # sample k is sample k % best_of of prompt k // best_of
    echo_of = [echoes[k // best_of] for k in range(len(samples.gens))] if echoes is not None else None
    if body.stream:  # best_of == n: sample k is choice k
        return _sse(_completion_chunks(samples, rid, s.model_name, body.include_usage, renderers, echo_of))
    wholes = await _wholes(samples)
    choices = []
    for first in range(0, len(wholes), best_of):
        group = wholes[first : first + best_of]
        order = range(best_of) if best_of == body.n else best_first(group)[: body.n]
        choices += [completion_choice(group[i], renderers[first + i], echo_of[first + i] if echo_of else None)
                    for i in order]
    for index, choice in enumerate(choices):
        choice.index = index
    return CompletionResponse(id=rid, model=s.model_name, choices=choices,
                              usage=_usage(samples, echoes[0] if echoes else None))


@router.post("/v1/chat/completions", response_model=None)
@cancel_on_disconnect
async def chat_completions(body: ChatCompletionRequest, s: State, request: Request) -> Response | ChatCompletionResponse:
    prompt = chat_prompt(s.checks.tokenizer, body.messages)

    async def start(i: int) -> Generation:
        return await _start(s, body, prompt, body.max_tokens or s.checks.max_seq_len, seed=_seed(body, i))

    samples = await start_samples(body.n, start)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    renderers = [_renderer(s, body) for _ in samples.gens]
    if body.stream:
        return _sse(_chat_chunks(samples, rid, s.model_name, body.include_usage, renderers))
    wholes = await _wholes(samples)
    choices = [
        ChatChoice(index=i, message=AssistantMessage(content=whole.text), finish_reason=whole.finish_reason,
                   logprobs=renderers[i].chat(whole.events) if renderers[i] else None)
        for i, whole in enumerate(wholes)
    ]
    return ChatCompletionResponse(id=rid, model=s.model_name, choices=choices, usage=_usage(samples))


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
    return TokenizeResponse(count=len(ids), max_model_len=s.checks.max_seq_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: State) -> DetokenizeResponse:
    """vLLM's: token ids back to text (``RequestError``, a 400, for an id outside the vocabulary)."""
    tokenizer = _tokenizer(s, body.model)
    check_token_ids(body.tokens, s.checks.vocab_size)
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


# -- shared steps --
async def _start(
    s: ServeState, body: GenerationFields, prompt: Prompt, max_tokens: int, *, seed: int | None,
    prompt_logprobs: int | None = None, logprobs: int | None = None,
) -> Generation:
    """Check the model name and queue one sample (``KVCacheError`` for a prompt the engine refuses);
    ``logprobs`` defaults to what the body asks for."""
    _check_model(s, body.model)
    sampling = SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
        seed=seed, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias, min_tokens=body.min_tokens,
        logprobs=body.num_logprobs if logprobs is None else logprobs, prompt_logprobs=prompt_logprobs,
    )
    handle = await s.engine.submit(prompt, sampling)
    return Generation(handle, StopStrings(body.stop), min_tokens=body.min_tokens)


def _encode_all(checks: RequestChecks, prompts: list[Prompt]) -> list[list[int]]:
    """Every prompt's token ids, checked as the engine checks them (the first bad one raises)."""
    return [checks.encode(prompt) for prompt in prompts]


def _seed(body: GenerationFields, i: int) -> int | None:
    """Sample ``i``'s seed: ``seed + i`` (each sample its own stream), unseeded without one."""
    return None if body.seed is None else body.seed + i


def _check_model(s: ServeState, model: str | None) -> None:
    if model is not None and model != s.model_name:
        raise model_not_found(model, s.model_name)


def _tokenizer(s: ServeState, model: str | None) -> object:
    _check_model(s, model)
    if s.checks.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot tokenize or detokenize")
    return s.checks.tokenizer


def _renderer(s: ServeState, body: GenerationFields) -> LogprobsRenderer | None:
    """A sample's log-probabilities renderer, ``None`` when the request asked for none."""
    return LogprobsRenderer(s.checks.tokenizer) if body.num_logprobs is not None else None


async def _wholes(samples: Samples) -> list[Piece]:
    """Every sample's text and tokens (an echo of the prompt alone waits for its one dropped token,
    so the request finishes as asked rather than as aborted)."""
    try:
        return await samples.wholes()
    except EngineFailure as e:
        raise engine_failure(str(e)) from e


def _usage(samples: Samples, echo: PromptEcho | None = None) -> Usage:
    """Each prompt's tokens once, and every sample's generated tokens (none for an echo of the
    prompt alone: ``echo``, any of the request's, says whether it was)."""
    generated = samples.completion_tokens if echo is None or echo.max_tokens else 0
    return Usage.of(samples.prompt_tokens, generated)


def _sse(chunks: AsyncIterator) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _completion_chunks(
    samples: Samples, rid: str, model: str, usage: bool, renderers: list[LogprobsRenderer | None],
    echoes: list[PromptEcho] | None,
) -> AsyncIterator[CompletionResponse]:
    """Each sample's pieces as chunks of its choice index; an echoed prompt (``echoes[index]``, the
    sample's prompt) comes first, each sample's own chunk (alone when ``max_tokens`` is 0). A chunk of
    text alone comes as its JSON."""
    created = unix_time()
    if echoes is not None:
        for index in range(len(samples.gens)):
            first = echoes[index].prompt_choice(renderers[index])
            first.index = index
            yield CompletionResponse(id=rid, model=model, created=created, choices=[first])
    text_json = CompletionChunkJSON(rid, model, created)
    async for index, piece in samples.pieces():
        if echoes is not None and not echoes[index].max_tokens:
            continue  # the one token an echo of the prompt alone generates is dropped
        if echoes is None and renderers[index] is None:
            yield text_json(index, piece.text, piece.finish_reason)
            continue
        choice = completion_choice(piece, renderers[index])
        choice.index = index
        yield CompletionResponse(id=rid, model=model, created=created, choices=[choice])
    if usage:
        yield CompletionResponse(id=rid, model=model, created=created, choices=[],
                                 usage=_usage(samples, echoes[0] if echoes else None))


async def _chat_chunks(
    samples: Samples, rid: str, model: str, usage: bool, renderers: list[LogprobsRenderer | None],
) -> AsyncIterator[ChatCompletionChunk]:
    created = unix_time()
    for index in range(len(samples.gens)):
        yield ChatCompletionChunk(id=rid, model=model, created=created, choices=[
            ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    text_json = ChatChunkJSON(rid, model, created)
    async for index, piece in samples.pieces():
        renderer = renderers[index]
        if renderer is None:
            yield text_json(index, piece.text, piece.finish_reason)
            continue
        delta = ChatDelta(content=piece.text) if piece.text else ChatDelta()
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=piece.finish_reason,
                                 logprobs=renderer.chat(piece.events))
        yield ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice])
    if usage:
        yield ChatCompletionChunk(id=rid, model=model, created=created, choices=[], usage=_usage(samples))
