"""MaskProver: masks are evaluated at enough token counts and positions to tell causal from not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kvgraph.errors import LoweringError
from kvgraph.passes import find_attention
from kvgraph.passes.causal_mask import MAX_CHECK_TOKENS, MaskProof, is_causal_table
from tests.naming import raises_naming
from tests.passes.lowering_helpers import VOCAB, TinyDecoder, capture, model_kwargs


def windowed(window: int):
    def attn(q, k, v):
        i = torch.arange(q.shape[2])
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    return attn


def test_window_wider_than_the_fixed_sizes_is_found_one_past_its_width():
    gm = capture(TinyDecoder(windowed(20)), **model_kwargs()).fresh()
    sites = find_attention.run(gm).sites
    assert [s.sliding_window for s in sites] == [20, 20]
    assert sites[0].mask == (MaskProof(sliding_window=20, token_counts=5, max_tokens=21),)
    assert sites[0].mask_text == "mask proven causal within a sliding window of 20 tokens at 5 token counts up to 21"


def test_window_beyond_the_checkable_size_is_refused():
    gm = capture(TinyDecoder(windowed(10_000)), **model_kwargs()).fresh()
    with raises_naming(LoweringError, "size 10000", f"{MAX_CHECK_TOKENS} tokens"):
        find_attention.run(gm)


def growing_window(q, k, v):
    """A band whose width depends on the token count: no one window."""
    T = q.shape[2]
    i = torch.arange(T)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (T + 1) // 2)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)


def windows_per_head(q, k, v):
    """Head 0 sees 2 tokens, the others everything before them: not one window for the site."""
    T = q.shape[2]
    i = torch.arange(T)
    causal = i[:, None] >= i[None, :]
    near = causal & (i[:, None] - i[None, :] < 2)
    mask = torch.stack([near] + [causal] * (q.shape[1] - 1))[None]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)


def gap_in_the_band(q, k, v):
    """Token i sees i and i - 2 but not i - 1: hidden tokens that no window explains."""
    i = torch.arange(q.shape[2])
    d = i[:, None] - i[None, :]
    mask = (d == 0) | (d == 2)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)


@pytest.mark.parametrize(("attn", "names"), [
    (growing_window, ("1 tokens at 2 tokens", "2 tokens at 3 tokens")),
    (windows_per_head, ("heads", "batch rows", "windows [2, None]")),
    (gap_in_the_band, ("token 0", "token 2", "sliding window")),
], ids=["growing", "per_head", "gap"])
def test_masks_that_are_no_one_window_are_refused(attn, names):
    gm = capture(TinyDecoder(attn), **model_kwargs()).fresh()
    with raises_naming(LoweringError, *names):
        find_attention.run(gm)


def test_window_of_unbounded_width_is_causal():
    gm = capture(TinyDecoder(windowed(1 << 40)), **model_kwargs()).fresh()
    sites = find_attention.run(gm).sites
    assert len(sites) == 2 and sites[0].mask_text.startswith("mask proven causal")


class PositionMask(nn.Module):
    """One attention layer whose boolean mask is built from position ids (and maybe another input's size)."""

    def __init__(self, absolute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.absolute = absolute
        self.wte = nn.Embedding(VOCAB, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, input_ids, position_ids, extra=None, pos_mask=None):
        T = input_ids.shape[1]
        q, k, v = (t.view(1, T, 2, 8).transpose(1, 2) for t in self.qkv(self.wte(input_ids)).split(16, -1))
        pos = position_ids[0]
        mask = pos[None, :] <= pos[:, None]  # [T, T]: kv position <= q position
        if self.absolute:
            mask = mask & (pos[None, :] < T)  # causal only while positions start at 0
        if extra is not None:
            mask = mask & (torch.arange(T)[None, :] < extra.shape[1])
        if pos_mask is not None:  # a padding mask: 1 for a token, 0 for padding
            mask = mask & (pos_mask[0][None, :] > 0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_relative_position_mask_is_causal():
    gm = capture(PositionMask(absolute=False), **model_kwargs()).fresh()
    (site,) = find_attention.run(gm).sites
    assert site.mask_text.startswith("mask proven causal")


def test_mask_causal_only_from_position_zero_is_refused():
    gm = capture(PositionMask(absolute=True), **model_kwargs()).fresh()
    with pytest.raises(LoweringError, match="positions starting at 3"):
        find_attention.run(gm)


def test_mask_reading_another_size_is_refused():
    gm = capture(PositionMask(absolute=False), extra=torch.zeros(1, 9), **model_kwargs()).fresh()
    with raises_naming(LoweringError, "mask", "size", "token count"):
        find_attention.run(gm)


def test_an_integer_input_named_like_positions_is_an_input():
    """Only the ``position_ids`` argument is evaluated as positions: a padding mask named
    ``pos_mask`` is an input like any other, and the mask that reads it is refused."""
    pos_mask = torch.ones(1, 6, dtype=torch.int64)
    gm = capture(PositionMask(absolute=False), pos_mask=pos_mask, **model_kwargs()).fresh()
    with raises_naming(LoweringError, "mask", "graph input 'l_pos_mask_'"):

        find_attention.run(gm)


def test_constant_buffers_read_through_get_attr_need_no_example_inputs(nanogpt):
    """Graphs that keep module buffers as attributes (get_attr) are checked from the module itself."""
    gm = nanogpt.fresh()
    names = [n.name for n in nanogpt.gm.graph.find_nodes(op="placeholder")]
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if node.name.endswith("_buffers_bias_"):
            gm.register_buffer(f"bias{i}", nanogpt.example_inputs[names.index(node.name)])
            with gm.graph.inserting_after(node):
                attr = gm.graph.get_attr(f"bias{i}")
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
    analysis = find_attention.run(gm)
    assert [s.mask for s in analysis.sites] == [(MaskProof(sliding_window=None, token_counts=5, max_tokens=32),)] * 2


@pytest.mark.parametrize(("table", "causal"), [
    (torch.ones(5, 5, dtype=torch.bool).tril(), True),
    (torch.ones(1, 1, 5, 5).tril(), True),
    (torch.full((5, 5), float("-inf")).triu(1), True),
    (torch.full((5, 5), torch.finfo(torch.float16).min, dtype=torch.float16).triu(1), True),
    (torch.ones(5, 5).tril() * torch.ones(5, 5).triu(-2), False),  # a window of 3
    (torch.ones(5, 5).tril().T, False),
    (torch.ones(4, 5).tril(), False),
], ids=["bool", "float01", "additive", "additive_fp16", "banded", "upper", "non_square"])
def test_causal_tables(table, causal):
    assert is_causal_table(table) == causal
