"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, log-probabilities).

Penalties, ``logit_bias`` and ``min_tokens`` change the logits before they reach :func:`sample`:
:class:`kvgraph.engine.penalties.LogitsProcessor` applies them to the rows that use them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvgraph.errors import ConfigError

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for with ``logprobs``."""
PENALTY_LIMIT = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in ``[-PENALTY_LIMIT, PENALTY_LIMIT]``."""
LOGIT_BIAS_LIMIT = 100.0
"""Each ``logit_bias`` value lies in ``[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]``."""


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
        presence_penalty: subtracted from the logit of every token generated at least once
            (OpenAI's definition, in ``[-2, 2]``; the prompt does not count).
        frequency_penalty: subtracted from the logit of every token once per time it was
            generated (OpenAI's definition, in ``[-2, 2]``; the prompt does not count).
        repetition_penalty: divides the positive logits and multiplies the negative ones of every
            token in the prompt or the output (Hugging Face's and vLLM's definition; > 0, 1: none).
        logit_bias: token id -> value added to its logit, each in ``[-100, 100]`` (-100 bans the
            token in practice); stored as ``((id, bias), ...)`` sorted by id.
        min_tokens: the EOS and ``stop_token_ids`` are masked out until this many tokens were
            generated (at most ``max_new_tokens``).
        logprobs: ``None``: none; ``N`` in ``[0, 20]``: each generated token's log-probability and
            the ``N`` most likely tokens' (see :class:`Logprobs` for which distribution).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
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
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ConfigError(f"stop_token_ids must be non-negative ints, got {t!r}")
        self._check_processing()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")

    def _check_processing(self) -> None:
        """The fields :class:`~kvgraph.engine.penalties.LogitsProcessor` applies."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ConfigError(f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0.0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for token, bias in self.logit_bias:
            if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ConfigError(
                    f"logit_bias of token {token} must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {bias!r}"
                )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any of the penalties, ``logit_bias`` or ``min_tokens`` changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with ``seed`` on ``device`` (``None`` for greedy or unseeded requests)."""
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _bias_pairs(bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``((id, bias), ...)`` sorted by id; ``ConfigError`` for an id that is not an int >= 0."""
    try:
        pairs = dict(bias.items() if isinstance(bias, Mapping) else bias)
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    for token in pairs:
        if not _is_int(token) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
    return tuple(sorted(pairs.items()))


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


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives
    (from the distribution it was sampled from: see :class:`Logprobs`).

    Attributes:
        logprob: the generated token's log-probability (``-inf`` for a token masked out).
        top: ``((token_id, logprob), ...)``: the request's ``logprobs`` most likely tokens, most likely first.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities for the rows of a batch whose request asked for them (``logprobs`` set).

    They are those of the distribution each row was sampled from: the logits after the penalties,
    ``logit_bias`` and ``min_tokens``, divided by the temperature (1 for greedy rows), before
    top-k / top-p filtering. A token masked out by ``min_tokens`` has ``-inf``.

    Attributes:
        rows: the batch rows that asked, in order; ``R = len(rows)``.
        chosen: ``float32 [R]``: the log-probability of each row's sampled token.
        top_ids: ``int64 [R, N]``: the ``N`` most likely tokens, most likely first (``N``: the most
            any of the rows asked for; a row asking fewer uses the first ones).
        top_logprobs: ``float32 [R, N]``: their log-probabilities.
    """

    rows: list[int]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def per_row(self, params: Sequence[SamplingParams]) -> dict[int, TokenLogprobs]:
        """Batch row -> its token's :class:`TokenLogprobs`, each with the alternatives its
        ``params[row].logprobs`` asks for (a host sync)."""
        chosen, ids, values = self.chosen.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        return {
            row: TokenLogprobs(chosen[i], tuple(zip(ids[i], values[i], strict=True))[: params[row].logprobs])
            for i, row in enumerate(self.rows)
        }


@dataclass(frozen=True)
class SamplerOutput:
    """What :func:`sample` picked.

    Attributes:
        tokens: ``int64 [B]``: one token per row.
        logprobs: for the rows that asked, ``None`` when none did.
    """

    tokens: torch.Tensor
    logprobs: Logprobs | None = None


_argmax_rows: list = []  # [kvgraph_cpu::argmax_rows or None], looked up at the first call
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # widened to float32 for it, exactly


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``int64 [B]``: each row's first largest logit (a NaN counted as the largest), on the logits'
    device. On the CPU with float32, bfloat16 or float16 logits, kvgraph's C++ ``argmax_rows``: it
    finds the maximum, then its first lane, both vectorized (2.7-2.9x ``torch.max(dim=-1)`` on
    float32 at 32-64 rows of 32000). bfloat16 and float16 logits are widened to float32 for it,
    exactly: 10 vs 30 us for ``torch.max`` on 1 x 32000 bfloat16, 0.21 vs 0.86 ms on 32 x 32000.
    Elsewhere ``max(dim).indices``, the same answer at a third of ``torch.argmax``'s time on the CPU
    (0.3 vs 0.86 ms for 32 x 32000)."""
    if (logits.device.type == "cpu" and logits.dtype in _ARGMAX_DTYPES and logits.dim() == 2
            and logits.shape[1] > 0):
        if not _argmax_rows:
            from kvgraph.ops import cpp

            _argmax_rows.append(cpp.argmax_kernel())
        if _argmax_rows[0] is not None:
            return _argmax_rows[0](logits.float())
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SamplerOutput:
    """Pick one token per row, with the log-probabilities of the rows that ask for them.

    Args:
        logits: ``float [B, V]``: next-token logits, one row per request (after the penalties,
            ``logit_bias`` and ``min_tokens`` of the rows that use them).
        params: ``B`` sampling parameters, row by row.
        generators: ``B`` generators (``None``: the global RNG), row by row.
    Returns:
        the tokens, ``int64 [B]``, and the :class:`Logprobs`, on ``logits.device`` (no host sync).
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ConfigError(
            f"sample got {logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators"
        )
    tokens = greedy_tokens(logits)  # [B]
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        scaled = filter_logits(logits[row].float() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    rows = [b for b, p in enumerate(params) if p.logprobs is not None]
    return SamplerOutput(tokens, _logprobs(logits, tokens, params, rows) if rows else None)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> Logprobs:
    """The :class:`Logprobs` of ``rows``: ``logits [B, V]``, ``tokens [B]`` as :func:`sample` has them."""
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([params[b].temperature or 1.0 for b in rows], device=logits.device)
    # logp: [R, V]
    logp = torch.log_softmax(logits[index].float() / temperature[:, None], dim=-1)
    top = torch.topk(logp, max(params[b].logprobs for b in rows), dim=-1)
    chosen = logp.gather(1, tokens[index][:, None])[:, 0]
    return Logprobs(rows, chosen, top.indices, top.values)
