"""Request and response bodies of the OpenAI-compatible endpoints, as pydantic models.

Requests validate what the engine cannot run (``suffix``, more than ``MAX_SAMPLES`` samples or
``MAX_PROMPTS`` prompts) with an error naming the field and the value, so that no request is
silently answered differently from what it asked. Unknown fields are ignored, as OpenAI's own
server does for fields it does not know.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgraph.engine.sampling import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, PENALTY_LIMIT

# -- requests --

MAX_SAMPLES = 16
"""The most samples one request may ask for (``n``, ``best_of``)."""

MAX_PROMPTS = 1024
"""The most prompts one ``/v1/completions`` request may hold (each runs as its own sequences)."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """Not in OpenAI's API (vLLM's): generate ``max_tokens`` tokens whatever comes."""
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as OpenAI sends it) -> bias in [-100, 100]."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Not in OpenAI's API (vLLM's): divides the positive logits and multiplies the negative ones
    of the prompt's and output's tokens."""
    min_tokens: int = Field(default=0, ge=0)
    """Not in OpenAI's API (vLLM's): no EOS or stop token before this many tokens."""

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        """``-1`` (and ``0``) mean no top-k, as in vLLM; otherwise at least 1."""
        if value is None or value in (-1, 0):
            return None
        if value < 1:
            raise ValueError(f"top_k must be >= 1, or -1 for all tokens, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias of token {key} must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _supported(self) -> GenerationFields:
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        return self

    @property
    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with int keys."""
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives each token's log-probabilities list (``None``: no log-probabilities)."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _prompts_of(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a list of texts or of token-id lists is several, anything
    else (a text, token ids) one."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: one prompt or several (up to ``MAX_PROMPTS``), each as text or
    token ids; ``n`` (and ``best_of``) samples of each."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    """0 only with ``echo``: the prompt (and its log-probabilities) alone, nothing generated."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Each token's log-probability and the ``logprobs`` most likely tokens' (up to ``logprobs + 1``
    entries: the chosen token is always there)."""
    echo: bool = False
    """The prompt comes first in the text; with ``logprobs``, its tokens too (the first with
    ``null``), scored by the model's raw log-probabilities (no temperature or penalties)."""
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, value):
        """At most ``MAX_PROMPTS`` prompts."""
        if len(_prompts_of(value)) > MAX_PROMPTS:
            raise ValueError(f"got {len(value)} prompts; one request holds at most {MAX_PROMPTS}")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order: one, or each of a list of texts or of token-id lists."""
        return _prompts_of(self.prompt)

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 needs echo=true: without the prompt there is nothing to return")
        if self.best_of is not None:
            if not self.n <= self.best_of <= MAX_SAMPLES:
                raise ValueError(f"best_of must be in [n={self.n}, {MAX_SAMPLES}], got {self.best_of}")
            if self.stream and self.best_of > self.n:
                raise ValueError(f"best_of={self.best_of} > n={self.n} cannot stream: the best are known at the end")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``. Without ``max_tokens`` (or ``max_completion_tokens``) the
    reply may run to the end of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses --


def unix_time() -> int:
    """Now, in whole seconds since the epoch: a response's ``created``."""
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """``/v1/completions``' ``logprobs``: per generated token, its text, log-probability, the most
    likely tokens' (the chosen one among them) and where its text begins in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    """``None`` only for an echoed prompt's first token, which nothing predicts."""
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """These tokens followed by ``other``'s (``self``, extended)."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset
        return self


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``/v1/chat/completions``' ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class _Choice(BaseModel):
    index: int = 0
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=unix_time)
    model: str


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    """A completion, and also each chunk of a streamed one (``usage`` only in the last, when asked)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
    owned_by: str = "kvgraph"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: ``True`` for a prompt, ``False`` for messages (the template writes its own)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
