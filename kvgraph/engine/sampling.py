"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvgraph.errors import ConfigError

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per position (as OpenAI's and vLLM's servers)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
        top_k: keep only the ``top_k`` most likely tokens (``None``: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: all).
        seed: seeds the request's own generator, so its samples do not depend on the batch it runs in.
        stop_token_ids: tokens that end the request (kept in the output), besides the model's EOS.
        ignore_eos: do not stop at the EOS token (benchmarks with a fixed output length).
        prompt_logprobs: score the prompt's own tokens (``Completion.prompt_logprobs``) with
            this many most likely alternatives per position (0 to ``MAX_LOGPROBS``); ``None``: don't.
            The prompt is then computed whole, never served from the prefix cache.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ConfigError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be None or an int, got {self.seed!r}")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ConfigError(
                f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ConfigError(f"stop_token_ids must be non-negative ints, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with ``seed`` on ``device`` (``None`` for greedy or unseeded requests)."""
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k / top-p set to ``-inf``.

    Args:
        logits: ``float [V]`` of one request, already divided by the temperature.
    Returns:
        ``float [V]``; the most likely token always survives.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``float [B, V]``: next-token logits, one row per request.
        params: ``B`` sampling parameters, row by row.
        generators: ``B`` generators (``None``: the global RNG), row by row.
    Returns:
        ``int64 [B]`` token ids on ``logits.device`` (no host sync).
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ConfigError(
            f"sample got {logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators"
        )
    # tokens: [B]
    tokens = torch.argmax(logits, dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        scaled = filter_logits(logits[row].float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens
