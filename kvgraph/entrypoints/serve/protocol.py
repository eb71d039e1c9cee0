"""Request and response bodies of the OpenAI-compatible endpoints, as pydantic models.

Requests validate what the engine cannot run (``n > 1``, log-probabilities, penalties, ...)
with an error naming the field and the value, so that no request is silently answered
differently from what it asked. Unknown fields are ignored, as OpenAI's own server does for
fields it does not know.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# -- requests --


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
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        """``-1`` (and ``0``) mean no top-k, as in vLLM; otherwise at least 1."""
        if value is None or value in (-1, 0):
            return None
        if value < 1:
            raise ValueError(f"top_k must be >= 1, or -1 for all tokens, got {value}")
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
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: this server returns one choice per request (n=1)")
        if self.logprobs not in (None, False, 0):
            raise ValueError(f"logprobs={self.logprobs!r} is not supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name}={getattr(self, name)} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        """A list holding one prompt is that prompt; several prompts in one request are refused."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"got {len(value)} prompts; send one request per prompt")
            return value[0]
        return value

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported (only 1)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


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

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


# -- responses --


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class _Choice(BaseModel):
    index: int = 0
    logprobs: None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=_now)
    model: str


class CompletionChoice(_Choice):
    text: str


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


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Choice):
    delta: ChatDelta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvgraph"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
