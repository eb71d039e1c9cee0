"""Penalties, ``logit_bias`` and ``min_tokens``: what changes a batch's raw logits before sampling.

Only the rows whose request uses one of them are touched: their ``[R, V]`` tensors are built once
per scheduled batch from the requests' token ids, updated on the device after each step (no host
sync between the steps of a multistep batch), and applied in a few passes over ``[R, V]``: the
repetition penalty as one factor per logit, the presence and frequency penalties and the bias as
one precomputed shift, then the ``min_tokens`` mask. A batch where no request uses them builds
nothing (:meth:`LogitsProcessor.build` returns ``None``).

Order: ``repetition_penalty`` on the raw logits, then ``logit_bias`` and the presence and frequency
penalties (added: their order does not matter), then ``min_tokens`` (EOS and stop tokens to ``-inf``).
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
        scale_pos, scale_neg: ``float32 [R, V]`` or ``None``: what ``repetition_penalty`` multiplies
            a positive / negative logit by (``1 / penalty`` and ``penalty`` for the tokens of the
            prompt and the output, 1 elsewhere).
        shift: ``float32 [R, V]`` or ``None``: added to the logits: ``logit_bias`` minus
            ``presence × (count > 0) + frequency × count``.
        counts: ``float32 [R, V]`` or ``None``: how often each row generated each token (with
            presence or frequency penalties).
        stops: ``bool [R, V]`` or ``None``: the tokens ``min_tokens`` masks, per row.
        min_left: ``int64 [R]`` or ``None``: tokens each row must still generate before its stops
            are allowed (<= 0: allowed).
        presence, frequency, repetition: ``float32 [R, 1]``: the rows' penalties.
    """

    def __init__(self, rows: list[int], params: Sequence[SamplingParams], tokens: Sequence[RowTokens],
                 vocab_size: int, device: torch.device) -> None:
        """``rows`` of the batch, with their ``params`` and ``tokens``; see :meth:`build`."""
        V = vocab_size
        self.rows = torch.tensor(rows, device=device)
        self.presence = _column([p.presence_penalty for p in params], device)
        self.frequency = _column([p.frequency_penalty for p in params], device)
        self.repetition = _column([p.repetition_penalty for p in params], device)
        self.scale_pos = self.scale_neg = None
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = _mask([[*row.prompt_ids, *row.output_ids] for row in tokens], V, device)
            self.scale_pos = torch.where(seen, 1.0 / self.repetition, 1.0)
            self.scale_neg = torch.where(seen, self.repetition, 1.0)
        self.shift = self.counts = None
        if any(p.logit_bias for p in params):
            self.shift = torch.zeros(len(rows), V, device=device)
            pairs = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
            r, t, b = zip(*pairs, strict=True)
            self.shift[list(r), list(t)] = torch.tensor(b, dtype=torch.float32, device=device)
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            self.counts = _mask([row.output_ids for row in tokens], V, device, counts=True)
            penalty = self.presence * (self.counts > 0) + self.frequency * self.counts
            self.shift = -penalty if self.shift is None else self.shift - penalty
        self.stops = self.min_left = None
        left = [p.min_tokens - len(row.output_ids) for p, row in zip(params, tokens, strict=True)]
        if any(n > 0 for n in left):
            stops = [(*p.stop_token_ids, *(() if p.ignore_eos else row.eos_token_ids)) if n > 0 else ()
                     for p, row, n in zip(params, tokens, left, strict=True)]
            self.stops = _mask(stops, V, device)
            self.min_left = torch.tensor(left, device=device)

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
        if self.scale_pos is not None:
            x = x * torch.where(x > 0, self.scale_pos, self.scale_neg)
        if self.shift is not None:
            x = x + self.shift
        if self.stops is not None:
            x = x.masked_fill(self.stops & (self.min_left > 0)[:, None], float("-inf"))
        return logits.float().index_put((self.rows,), x)

    def advance(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (``int64 [B]``, the whole batch's), for the next step."""
        # new: [R, 1]
        new = tokens[self.rows][:, None]
        if self.scale_pos is not None:
            self.scale_pos.scatter_(1, new, 1.0 / self.repetition)
            self.scale_neg.scatter_(1, new, self.repetition)
        if self.counts is not None:
            first = self.counts.gather(1, new) == 0
            self.shift.scatter_add_(1, new, -(self.presence * first + self.frequency))
            self.counts.scatter_add_(1, new, torch.ones_like(new, dtype=self.counts.dtype))
        if self.min_left is not None:
            self.min_left -= 1


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
