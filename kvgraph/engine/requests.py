"""Per-request state of the engine, and what the engine hands back: completions and stream events."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvgraph.engine.prompt_logprobs import PromptLogprob
from kvgraph.engine.sampling import SamplingParams, TokenLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"
    """The EOS token or one of ``stop_token_ids`` was generated (it is kept in the output)."""
    LENGTH = "length"
    """``max_new_tokens`` generated, or the sequence reached ``max_seq_len``."""
    ABORT = "abort"
    """Aborted by the caller, or torn down by an interrupt or a kvgraph error while running."""
    ERROR = "error"
    """The model raised during the request's step; the request's ``error`` says what."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """One generation request as the scheduler sees it.

    The request's context is ``prompt_ids + output_ids``; ``num_computed`` of its
    leading tokens are in the KV cache. Decoding is the case ``len(context) - num_computed == 1``;
    a (chunked) prefill or a recompute after preemption has more left.
    """

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    seq_id: int | None = None  # the manager's id while claimed
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache on the first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # the exception that failed the request's step (finish_reason ERROR)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token when sampling.logprobs is set
    detokenizer: object | None = None  # an IncrementalDetokenizer once the output is streamed as text
    prompt_logprobs: list[PromptLogprob | None] | None = None  # with sampling.prompt_logprobs: [None, ...]

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (``sampling.prompt_logprobs``)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:
        """Context tokens not yet in the cache."""
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_remaining == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_reason(self, token: int, max_seq_len: int) -> FinishReason | None:
        """Why the request ends after ``token`` was appended, if it does."""
        p = self.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(self.output_ids) >= p.max_new_tokens or self.num_tokens > max_seq_len:
            return FinishReason.LENGTH
        return None

    def tokens_left(self, max_seq_len: int) -> int:
        """Tokens this request may still generate before hitting a length limit."""
        return min(self.sampling.max_new_tokens - len(self.output_ids), max_seq_len + 1 - self.num_tokens)


@dataclass
class Completion:
    """The result of one prompt.

    Attributes:
        token_ids: the generated tokens (prompt excluded).
        text: their decoded text (``None`` without a tokenizer).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
        prompt_tokens: the prompt's length in tokens.
        cached_tokens: prompt tokens served by the prefix cache instead of being computed.
        arrival_time: ``time.perf_counter()`` when the request was queued.
        token_times: ``time.perf_counter()`` when each generated token was ready.
        error: with ``finish_reason == "error"``, the exception the model raised
            (``"RuntimeError: ..."``); ``None`` otherwise.
        logprobs: one per generated token when the request's ``SamplingParams.logprobs`` is set,
            else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token
            (``None`` for the first, which nothing predicts); else ``None``.
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    arrival_time: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None

    def __repr__(self) -> str:
        """The outcome in one line: ids and text shortened, timings left out."""
        ids = self.token_ids if len(self.token_ids) <= 8 else [*self.token_ids[:8], "..."]
        ids_text = ", ".join(map(str, ids))
        text = self.text if self.text is None or len(self.text) <= 40 else self.text[:40] + "..."
        error = f", error={self.error!r}" if self.error is not None else ""
        return (
            f"Completion(finish_reason={self.finish_reason!r}, {len(self.token_ids)} tokens [{ids_text}], "
            f"text={text!r}, prompt_tokens={self.prompt_tokens}, cached_tokens={self.cached_tokens}{error})"
        )

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from queueing to the first token."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True, kw_only=True)
class TokenEvent:
    """One generated token, as ``LLM.step`` returns it and ``LLM.stream`` yields it.

    Attributes:
        request_id: the id ``LLM.add_request`` returned.
        token_id: the new token; ``None`` on the one event of a request whose step failed.
        text: the text this token adds (``None`` without a tokenizer).
        finish_reason: set on the request's last token (``"error"`` when its step failed).
        error: the exception of a failed step (``"RuntimeError: ..."``), else ``None``.
        prompt_index: from ``LLM.stream``, the prompt's position in that call; ``None`` elsewhere.
        logprobs: the token's log-probabilities when the request asked for them, else ``None``.
        prompt_logprobs: on a request's first token when it scored its prompt
            (``SamplingParams.prompt_logprobs``): one entry per prompt token, ``None`` for the first.
    """

    request_id: int
    token_id: int | None
    text: str | None
    finish_reason: str | None
    error: str | None = None
    prompt_index: int | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
