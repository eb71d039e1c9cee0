"""Prompt checks done before a request is queued: tokens, lengths, and whether the cache can ever hold it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.managers.paged import PagedKVCacheManager
from kvgraph.engine.sampling import SamplingParams
from kvgraph.errors import OutOfPagesError, RequestError, SequenceLengthError

Prompt = str | Sequence[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise RequestError(
            f"prompts must be a string, a list of token ids, or a list of those, got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def encode_prompt(prompt: Prompt, tokenizer: object | None, vocab_size: int | None, max_seq_len: int) -> list[int]:
    """The prompt's token ids; ``RequestError`` for text without a tokenizer, an empty prompt or
    an id outside ``[0, vocab_size)``, ``SequenceLengthError`` past ``max_seq_len``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"text prompt {prompt[:32]!r} needs a tokenizer; this LLM has none (pass token ids)")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
    if not ids:
        raise RequestError("prompt is empty; it needs at least one token")
    check_token_ids(ids, vocab_size, "prompt token")
    if len(ids) > max_seq_len:
        raise SequenceLengthError(f"prompt of {len(ids)} tokens is longer than max_seq_len={max_seq_len}")
    return ids


def check_token_ids(ids: Sequence[object], vocab_size: int | None, what: str = "token") -> None:
    """``RequestError`` naming the first of ``ids`` that is not an int in ``[0, vocab_size)``, and the
    vocabulary size (``what`` says what the ids are, for the message)."""
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise RequestError(f"{what} {t!r} is not an id in [0, {vocab_size})")


def check_sampling(sampling: SamplingParams | None, vocab_size: int | None) -> SamplingParams:
    """``sampling`` (default ``SamplingParams()``); ``RequestError`` for another type, or a stop
    or ``logit_bias`` token outside ``[0, vocab_size)``."""
    sampling = sampling if sampling is not None else SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise RequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop token")
    check_token_ids([t for t, _ in sampling.logit_bias], vocab_size, "logit_bias token")
    return sampling


@dataclass(frozen=True)
class RequestChecks:
    """Every check ``add_request`` makes of a request before queueing it, from what does not change
    once the engine is built: it needs neither the engine nor its lock, and it pickles (tokenizer
    included), so another process can tokenize and check requests exactly as the engine would.

    Attributes:
        tokenizer: encodes text prompts (``None``: token ids only).
        vocab_size: token ids must be in ``[0, vocab_size)`` (``None``: not checked).
        max_seq_len: the longest context, prompt and generated tokens together.
        page_size, total_pages: the paged pool's, which a request must fit running alone (``None``
            for continuous slots, which hold any request up to ``max_seq_len``).
        capacity: the cache's size in words, for the error.
    """

    tokenizer: object | None
    vocab_size: int | None
    max_seq_len: int
    page_size: int | None
    total_pages: int | None
    capacity: str

    @classmethod
    def of(cls, manager: KVCacheManager, tokenizer: object | None, vocab_size: int | None,
           max_seq_len: int) -> RequestChecks:
        paged = isinstance(manager, PagedKVCacheManager)
        return cls(tokenizer, vocab_size, max_seq_len, manager.page_size if paged else None,
                   manager.total_pages if paged else None, capacity_text(manager))

    def __call__(self, prompt: Prompt, sampling: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling (default ``SamplingParams()``), checked:
        ``RequestError``, ``SequenceLengthError`` or ``OutOfPagesError`` naming the value and the limit."""
        sampling = check_sampling(sampling, self.vocab_size)
        ids = encode_prompt(prompt, self.tokenizer, self.vocab_size, self.max_seq_len)
        self._check_fits(ids, sampling)
        return ids, sampling

    def encode(self, prompt: Prompt, sampling: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids after every check (``LLM.encode``)."""
        return self(prompt, sampling)[0]

    def _check_fits(self, ids: list[int], sampling: SamplingParams) -> None:
        """``OutOfPagesError`` if the request needs more pages than the whole pool, even running alone."""
        if self.page_size is None:
            return
        # the last generated token is returned, never fed back: it takes no cache
        tokens = min(len(ids) + sampling.max_new_tokens - 1, self.max_seq_len)
        pages = -(-tokens // self.page_size)
        if pages > self.total_pages:
            raise OutOfPagesError(
                f"a request of {len(ids)} prompt + {sampling.max_new_tokens} new tokens caches {tokens} tokens and "
                f"needs {pages} pages; {self.capacity}"
            )


def capacity_text(manager: KVCacheManager) -> str:
    if isinstance(manager, PagedKVCacheManager):
        return f"the pool has {manager.total_pages} pages of {manager.page_size} tokens"
    return f"{manager.max_batch_size} slots of {manager.max_seq_len} tokens"
