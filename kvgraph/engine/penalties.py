"""Penalties, ``logit_bias`` and ``min_tokens``: what changes a batch's raw logits before sampling.

Only the rows whose request uses one of them are touched: their ``[R, V]`` tensors are built once
per scheduled batch from the requests' token ids, updated on the device after each step (no host
sync between the steps of a multistep batch), and applied with a handful of tensor ops. A batch
where no request uses them builds nothing (:meth:`LogitsProcessor.build` returns ``None``).

Order, as vLLM's sampler: ``logit_bias``, then ``min_tokens`` (EOS and stop tokens to ``-inf``),
then the repetition, frequency and presence penalties.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvgraph.engine.sampling import SamplingParams


class RowTokens(Protocol):
    """What one row's request has seen so far (an ``EngineRequest`` is one).

    Attributes:
        prompt_ids: the prompt (counts for ``repetition_penalty`` only).
        output_ids: the tokens generated so far.
        eos_token_ids: the model's EOS tokens (masked by ``min_tokens`` unless ``ignore_eos``).
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_token_ids: Sequence[int]


class LogitsProcessor:
    """The penalties, ``logit_bias`` and ``min_tokens`` of the rows of one batch that use them.

    Each tensor holds only the ``R`` rows that use some of these fields (``rows`` maps them to the
    batch), and is ``None`` when none of them uses its feature.

    Attributes:
        rows: ``int64 [R]``: the batch rows this processor changes.
        bias: ``float32 [R, V]`` or ``None``: each row's ``logit_bias``, dense.
        stops: ``bool [R, V]`` or ``None``: the tokens ``min_tokens`` masks, per row.
        min_left: ``int64 [R]`` or ``None``: tokens each row must still generate before its stops
            are allowed (<= 0: allowed).
        counts: ``float32 [R, V]`` or ``None``: how often each row generated each token.
        seen: ``bool [R, V]`` or ``None``: tokens in each row's prompt or output.
        presence, frequency, repetition: ``float32 [R, 1]``: the rows' penalties.
    """

    def __init__(self, rows: list[int], params: Sequence[SamplingParams], tokens: Sequence[RowTokens],
                 vocab_size: int, device: torch.device) -> None:
        """``rows`` of the batch, with their ``params`` and ``tokens``; see :meth:`build`."""
        R, V = len(rows), vocab_size
        self.rows = torch.tensor(rows, device=device)
        self.presence = _column([p.presence_penalty for p in params], device)
        self.frequency = _column([p.frequency_penalty for p in params], device)
        self.repetition = _column([p.repetition_penalty for p in params], device)
        self.bias = None
        if any(p.logit_bias for p in params):
            # bias: [R, V]
            self.bias = torch.zeros(R, V, device=device)
            pairs = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
            r, t, b = zip(*pairs, strict=True)
            self.bias[list(r), list(t)] = torch.tensor(b, dtype=torch.float32, device=device)
        self.stops = self.min_left = None
        left = [p.min_tokens - len(row.output_ids) for p, row in zip(params, tokens, strict=True)]
        if any(n > 0 for n in left):
            stops = [(*p.stop_token_ids, *(() if p.ignore_eos else row.eos_token_ids))
                     for p, row in zip(params, tokens, strict=True)]
            self.stops = _mask([s if n > 0 else () for s, n in zip(stops, left, strict=True)], V, device)
            self.min_left = torch.tensor(left, device=device)
        self.counts = None
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            self.counts = _mask([row.output_ids for row in tokens], V, device, counts=True)
        self.seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            self.seen = _mask([[*row.prompt_ids, *row.output_ids] for row in tokens], V, device)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], tokens: Sequence[RowTokens], vocab_size: int,
              device: torch.device) -> LogitsProcessor | None:
        """The processor of a batch's rows, or ``None`` when no row uses any of these fields.

        Args:
            params: ``B`` sampling parameters, row by row.
            tokens: ``B`` rows' token ids (read only for the rows whose ``params`` are ``penalized``).
            vocab_size: ``V``, the logits' last dimension.
            device: where the logits are.
        """
        rows = [b for b, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        return cls(rows, [params[b] for b in rows], [tokens[b] for b in rows], vocab_size, device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``float [B, V]``) with the rows' changes applied: a new ``float32`` tensor."""
        # x: [R, V]
        x = logits[self.rows].float()
        if self.bias is not None:
            x = x + self.bias
        if self.stops is not None:
            x = x.masked_fill(self.stops & (self.min_left > 0)[:, None], float("-inf"))
        if self.seen is not None:
            penalized = torch.where(x > 0, x / self.repetition, x * self.repetition)
            x = torch.where(self.seen, penalized, x)
        if self.counts is not None:
            x = x - self.presence * (self.counts > 0) - self.frequency * self.counts
        return logits.float().index_put((self.rows,), x)

    def advance(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (``int64 [B]``, the whole batch's), for the next step."""
        # new: [R, 1]
        new = tokens[self.rows][:, None]
        if self.min_left is not None:
            self.min_left -= 1
        if self.counts is not None:
            self.counts.scatter_add_(1, new, torch.ones_like(new, dtype=self.counts.dtype))
        if self.seen is not None:
            self.seen.scatter_(1, new, True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _mask(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device, counts: bool = False) -> torch.Tensor:
    """``[R, V]``: per row, which of ``ids[r]`` occur (``bool``), or how often (``float32`` with ``counts``)."""
    rows = [r for r, row in enumerate(ids) for _ in row]
    cols = [t for row in ids for t in row]
    out = torch.zeros(len(ids), vocab_size, dtype=torch.float32 if counts else torch.bool, device=device)
    if cols:
        values = torch.ones(len(cols), dtype=out.dtype, device=device)
        out.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)), values,
                       accumulate=counts)
    return out
