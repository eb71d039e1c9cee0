"""Fuzzed lowering: every generated attention module lowers and matches eager, or is refused.

Hypothesis draws small decoders whose attention is SDPA or the explicit ``matmul -> scale ->
mask -> softmax -> matmul`` pattern, with GQA ratios 1/2/4 (K/V repeated by expand+reshape,
``repeat_interleave`` or ``enable_gqa``), the default or an explicit scale, and a causal mask
written in one of the ways models write it (``is_causal``, a ``tril`` or additive registered
buffer, ``triu``, an ``arange`` comparison, a sliding window of 3 tokens). A supported module
must lower and give eager's logits on a ragged, paged two-sequence batch over three steps; a
module that must be refused (additive bias, no mask, cross-attention, a padding mask, dropout
while training) must raise ``LoweringError``.

Tracing a module with Dynamo costs about a second, so each module is captured and lowered once
and every example also draws what it runs: prompt lengths, chunk sizes and token ids. CI's
profile ``lowering-ci`` (300 derandomized examples) draws its modules from a set that covers every
pair of values of (kind, mask, GQA form, scale) with 1 or 2 KV heads of size 8;
``KVGRAPH_FUZZ_PROFILE=lowering-fuzz`` (``make fuzz``) draws from the whole space, head sizes
4 and 8 and one or two layers.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraph.errors import LoweringError
from kvgraph.passes.pipeline import lower
from tests.passes.lowering_helpers import VOCAB, capture, steps_against_eager

settings.register_profile(
    "lowering-ci", max_examples=300, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "lowering-fuzz", max_examples=5000, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile(os.environ.get("KVGRAPH_FUZZ_PROFILE", "lowering-ci"))

CAUSAL = ("is_causal", "tril_buffer", "additive_buffer", "triu", "arange_compare", "sliding_window")
REFUSED = ("additive_bias", "no_mask", "cross_attention", "padding_mask", "dropout_training")
MAX_T = 32  # rows of the registered mask buffers
WINDOW = 3
SCALE = 0.37


@dataclass(frozen=True)
class Spec:
    """One generated attention module."""

    kind: str  # "sdpa" or "explicit"
    n_kv_heads: int
    ratio: int  # query heads per KV head
    head_dim: int
    repeat: str  # how K/V reach Hq heads: "expand", "interleave" or "enable_gqa" (SDPA)
    scale: float | None  # None: the default 1/sqrt(head_dim)
    mask: str  # one of CAUSAL or REFUSED
    n_layer: int

    @property
    def must_refuse(self) -> bool:
        return self.mask in REFUSED


GQA_FORMS = ((1, "expand"), (2, "expand"), (4, "expand"), (2, "interleave"), (4, "interleave"),
             (2, "enable_gqa"), (4, "enable_gqa"))  # (query heads per KV head, how K/V are repeated)


def _valid(kind: str, gqa: tuple[int, str], mask: str) -> bool:
    return kind == "sdpa" or (gqa[1] != "enable_gqa" and mask != "is_causal")


def all_specs(head_dims=(4, 8), layers=(1, 2)) -> list[Spec]:
    return [
        Spec(kind, hkv, ratio, d, repeat, scale, mask, n)
        for kind, (ratio, repeat), mask, scale, hkv, d, n in itertools.product(
            ("sdpa", "explicit"), GQA_FORMS, CAUSAL + REFUSED, (None, SCALE), (1, 2), head_dims, layers)
        if _valid(kind, (ratio, repeat), mask)
    ]


def pairwise_specs() -> list[Spec]:
    """Specs of one layer and head size 8 in which every pair of values of (kind, mask, GQA form,
    scale, KV heads) that can occur together occurs at least once (greedy cover)."""
    def pairs(spec: Spec) -> set:
        values = (spec.kind, spec.mask, (spec.ratio, spec.repeat), spec.scale, spec.n_kv_heads)
        return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(values), 2)}

    candidates = all_specs(head_dims=(8,), layers=(1,))
    missing = set().union(*map(pairs, candidates))
    chosen = []
    while missing:
        best = max(candidates, key=lambda c: len(pairs(c) & missing))
        chosen.append(best)
        missing -= pairs(best)
    return chosen


@dataclass(frozen=True)
class Run:
    """What one example runs on a lowered module: two sequences over three steps."""

    prompts: tuple[int, int]  # prompt lengths
    chunks: tuple[tuple[int, int], tuple[int, int]]  # new tokens of each sequence at steps 2 and 3
    seed: int  # token ids


runs = st.builds(
    Run,
    prompts=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    chunks=st.tuples(st.tuples(st.integers(1, 3), st.integers(1, 3)), st.tuples(st.integers(1, 3), st.integers(1, 3))),
    seed=st.integers(0, 2**16),
)
FUZZ = os.environ.get("KVGRAPH_FUZZ_PROFILE") == "lowering-fuzz"
modules = st.sampled_from(all_specs() if FUZZ else pairwise_specs())


class FuzzDecoder(nn.Module):
    """Embeddings, ``spec.n_layer`` attention blocks written as ``spec`` says, and a head."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spec = spec
        self.hq = spec.n_kv_heads * spec.ratio
        C = self.hq * spec.head_dim
        self.wte = nn.Embedding(VOCAB, C)
        self.wpe = nn.Embedding(64, C)
        self.q = nn.ModuleList(nn.Linear(C, C) for _ in range(spec.n_layer))
        self.kv = nn.ModuleList(nn.Linear(C, 2 * spec.n_kv_heads * spec.head_dim) for _ in range(spec.n_layer))
        self.out = nn.ModuleList(nn.Linear(C, C) for _ in range(spec.n_layer))
        self.head = nn.Linear(C, VOCAB)
        lower_triangle = torch.ones(MAX_T, MAX_T, dtype=torch.bool).tril()
        self.register_buffer("causal", lower_triangle, persistent=False)
        self.register_buffer("causal_bias", torch.zeros(MAX_T, MAX_T).masked_fill(~lower_triangle, float("-inf")),
                             persistent=False)
        self.train(spec.mask == "dropout_training")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, memory: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        x = self.wte(input_ids) + self.wpe(position_ids)  # [1, T, C]
        T = x.shape[1]
        for q_proj, kv_proj, out in zip(self.q, self.kv, self.out, strict=True):
            q = q_proj(x).view(1, T, self.hq, s.head_dim).transpose(1, 2)  # [1, Hq, T, D]
            source = memory if memory is not None else x
            k, v = kv_proj(source).view(1, source.shape[1], 2 * s.n_kv_heads, s.head_dim).transpose(1, 2).chunk(2, 1)
            y = self.attend(q, k, v, attention_mask)  # [1, Hq, T, D]
            x = x + out(y.transpose(1, 2).reshape(1, T, -1))
        return self.head(x)

    def attend(self, q, k, v, attention_mask):
        s = self.spec
        if s.repeat != "enable_gqa":
            k, v = self.repeat(k), self.repeat(v)
        if s.kind == "sdpa":
            return self.sdpa(q, k, v, attention_mask)
        scores = q @ k.transpose(-2, -1)
        scores = scores * s.scale if s.scale is not None else scores / math.sqrt(s.head_dim)
        keep, bias = self.mask(q.shape[2], k.shape[2], q.device, attention_mask)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        if bias is not None:
            scores = scores + bias
        weights = torch.softmax(scores.float(), dim=-1).type_as(q)
        if s.mask == "dropout_training":
            weights = F.dropout(weights, p=0.1, training=self.training)
        return weights @ v

    def sdpa(self, q, k, v, attention_mask):
        s = self.spec
        kwargs = {"scale": s.scale, "enable_gqa": s.repeat == "enable_gqa"}
        if s.mask == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
        if s.mask == "dropout_training":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1, **kwargs)
        keep, bias = self.mask(q.shape[2], k.shape[2], q.device, attention_mask)
        if keep is None and bias is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, **kwargs)
        if keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **kwargs)

    def repeat(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, Hkv, T, D] -> [1, Hq, T, D]``, head ``h`` from KV head ``h // ratio``."""
        n = self.spec.ratio
        if n == 1:
            return x
        if self.spec.repeat == "interleave":
            return x.repeat_interleave(n, dim=1)
        B, H, T, D = x.shape
        return x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)

    def mask(self, T: int, S: int, device, attention_mask):
        """``(keep [T, S] bool or None, additive bias [T, S] or None)`` for ``spec.mask``."""
        m = self.spec.mask
        i = torch.arange(T, device=device)
        if m in ("tril_buffer", "cross_attention"):
            return self.causal[:T, :S], None
        if m == "additive_buffer":
            return None, self.causal_bias[:T, :T]
        if m in ("triu", "dropout_training"):
            return ~torch.triu(torch.ones(T, T, dtype=torch.bool, device=device), diagonal=1), None
        if m == "arange_compare":
            return i[:, None] >= i[None, :], None
        if m == "sliding_window":
            distance = i[:, None] - i[None, :]
            return (distance >= 0) & (distance < WINDOW), None
        if m == "additive_bias":
            distance = (i[:, None] - i[None, :]).float()
            return i[:, None] >= i[None, :], -0.25 * distance
        if m == "padding_mask":
            return (i[:, None] >= i[None, :]) & attention_mask[0, None, :].bool(), None
        return None, None  # no_mask


def capture_kwargs(spec: Spec, T: int = 6) -> dict:
    g = torch.Generator().manual_seed(T)
    kwargs = {"input_ids": torch.randint(0, VOCAB, (1, T), generator=g), "position_ids": torch.arange(T)[None]}
    if spec.mask == "padding_mask":
        kwargs["attention_mask"] = torch.ones(1, T, dtype=torch.long)
    if spec.mask == "cross_attention":
        kwargs["memory"] = torch.randn(1, T, spec.n_kv_heads * spec.ratio * spec.head_dim, generator=g)
    return kwargs


@functools.cache
def lowered(spec: Spec):
    """``(model, captured graph, LoweringResult or the LoweringError that refused it)``, once per spec."""
    model = FuzzDecoder(spec)
    captured = capture(model, **capture_kwargs(spec))
    try:
        return model, captured, lower(captured.fresh(), page_size=4, example_inputs=captured.example_inputs)
    except LoweringError as refusal:
        return model, captured, refusal


def check(spec: Spec, run: Run) -> None:
    _, captured, result = lowered(spec)
    if spec.must_refuse:
        assert isinstance(result, LoweringError), f"{spec.mask} was lowered"
        return
    assert not isinstance(result, LoweringError), f"a supported module was refused: {result}"
    assert len(result.sites) == spec.n_layer
    window = WINDOW if spec.mask == "sliding_window" else None
    assert [s.sliding_window for s in result.sites] == [window] * spec.n_layer
    assert result.params.n_kv_heads == spec.n_kv_heads  # K/V cached un-repeated
    g = torch.Generator().manual_seed(run.seed)
    steps = [[torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
             for lengths in (run.prompts, *run.chunks)]
    steps_against_eager(captured, result, steps, max_len=16, atol=1e-4, rtol=1e-4)


@settings(PROFILE)
@given(spec=modules, run=runs)
def test_every_generated_module_lowers_exactly_or_is_refused(spec, run):
    check(spec, run)
