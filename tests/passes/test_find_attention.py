"""find_attention: which attention forms are recognised (and lowered correctly), which are refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

from kvgraph.errors import LoweringError
from kvgraph.passes import find_attention, lower
from kvgraph.passes.find_attention import AttentionKind, KnownWindows, WindowOrigin, WindowTaken
from kvgraph.passes.patterns import KVRepeat
from tests.naming import raises_naming
from tests.nanogpt_model import NanoGPT
from tests.passes.lowering_helpers import (
    VOCAB,
    RaggedCache,
    TinyDecoder,
    capture,
    eager_last_logits,
    hf_kwargs,
    lowered_ops,
    model_kwargs,
    run_step,
    steps_against_eager,
    tiny_llama,
    tiny_qwen2,
)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """HF's repeat_kv: [B, Hkv, T, D] -> [B, Hkv * n, T, D], head h reads kv head h // n."""
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)


def causal_bool(T: int) -> torch.Tensor:
    i = torch.arange(T)
    return i[:, None] >= i[None, :]


# -- attention forms that must be lowered --
def sdpa_is_causal(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)


def sdpa_enable_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_interleave_scale(q, k, v):
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def sdpa_bool_mask(q, k, v):
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)


def sdpa_float_mask(q, k, v):
    mask = torch.full((q.shape[2], q.shape[2]), float("-inf")).triu(1)
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)


def explicit_where_div(q, k, v):
    scores = q @ repeat_kv(k, 2).transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = torch.where(causal_bool(q.shape[2]), scores, float("-inf"))
    weights = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p=0.0, training=False)
    return weights @ repeat_kv(v, 2)


LOWERED = {
    sdpa_is_causal: (KVRepeat.EXPAND_RESHAPE, None),
    sdpa_enable_gqa: (KVRepeat.ENABLE_GQA, None),
    sdpa_interleave_scale: (KVRepeat.REPEAT_INTERLEAVE, 0.3),
    sdpa_bool_mask: (KVRepeat.EXPAND_RESHAPE, None),
    sdpa_float_mask: (KVRepeat.EXPAND_RESHAPE, None),
    explicit_where_div: (KVRepeat.EXPAND_RESHAPE, 1 / math.sqrt(8)),
}


@pytest.mark.parametrize("attn", list(LOWERED), ids=lambda f: f.__name__)
def test_recognised_forms_lower_and_match_eager(attn):
    cap = capture(TinyDecoder(attn), **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    repeat, scale = LOWERED[attn]
    assert [(s.repeat, s.n_heads, s.n_kv_heads, s.head_dim) for s in result.sites] == [(repeat, 4, 2, 8)] * 2
    assert all(s.scale == pytest.approx(scale) if scale else s.scale is None for s in result.sites)
    cache = RaggedCache(result.params, batch=2)
    seqs = [[3, 5, 7, 11], [13, 17, 19]]
    logits = run_step(gm, cap, cache, seqs)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(cap.model, s), atol=1e-5, rtol=0)


def test_nanogpt_buffer_mask_is_proven_on_the_whole_buffer(nanogpt):
    analysis = find_attention.run(nanogpt.fresh(), nanogpt.example_inputs)
    assert [s.kind for s in analysis.sites] == [AttentionKind.EXPLICIT] * 2
    assert all(s.scale == pytest.approx(1 / math.sqrt(8)) for s in analysis.sites)
    assert analysis.sites[0].mask[0].max_tokens == 32  # the 32 x 32 causal buffer, checked at T = 32


def test_buffer_mask_without_its_value_is_refused(nanogpt):
    with pytest.raises(LoweringError, match=r"l_self_modules_h_modules_0_modules_attn_buffers_bias_.*example_inputs"):
        find_attention.run(nanogpt.fresh())


def test_mask_only_nodes_are_the_mask_subgraph(llama_sdpa):
    analysis = find_attention.run(llama_sdpa.fresh())
    names = {n.name for n in analysis.mask_nodes}
    assert {"attention_mask", "packed_sequence_mask", "q_arange", "kv_indices"} <= names
    assert not any(n.op == "placeholder" for n in analysis.mask_nodes)
    rope = [n for n in llama_sdpa.gm.graph.nodes if n.name in ("cos", "sin", "freqs")]
    assert rope and not set(rope) & analysis.mask_nodes


def sdpa_sliding_window(q, k, v):
    i = torch.arange(q.shape[2])
    mask = causal_bool(q.shape[2]) & (i[:, None] - i[None, :] < 3)
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)


def explicit_sliding_window(q, k, v):
    i = torch.arange(q.shape[2])
    scores = q @ repeat_kv(k, 2).transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~causal_bool(q.shape[2]), float("-inf"))
    scores = scores.masked_fill(i[:, None] - i[None, :] >= 3, float("-inf"))
    return torch.softmax(scores, dim=-1) @ repeat_kv(v, 2)


@pytest.mark.parametrize("attn", [sdpa_sliding_window, explicit_sliding_window], ids=lambda f: f.__name__)
def test_sliding_window_lowers_with_its_width_and_matches_eager_past_it(attn):
    cap = capture(TinyDecoder(attn), **model_kwargs())
    result = lower(cap.fresh())
    assert [s.sliding_window for s in result.sites] == [3, 3]
    [call] = {tuple(n.args[-2:]) for n in lowered_ops(result.gm)}
    assert call == (3, None)  # the op carries the window (and no soft-cap)
    # a prefill longer than the window, then chunks and single tokens that read the cache past it
    steps_against_eager(cap, result, [[[3, 5, 7, 11, 2], [13, 17]], [[19], [23, 29, 31, 37]], [[41, 43], [47]],
                                      [[53], [59]]])


def soft_capped(cap: float = 0.5, mask_first: bool = False, scale_after: bool = False):
    """Gemma 2's explicit attention: scale, ``/ cap -> tanh -> * cap``, then the causal mask."""
    def attn(q, k, v):
        scores = q @ repeat_kv(k, 2).transpose(-2, -1) * 2.0
        hidden = ~causal_bool(q.shape[2])
        if mask_first:
            scores = scores.masked_fill(hidden, float("-inf"))
        scores = torch.tanh(scores / cap) * cap
        if scale_after:
            scores = scores * 0.5
        if not mask_first:
            scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores, dim=-1) @ repeat_kv(v, 2)
    return attn


def test_soft_capped_scores_lower_with_the_cap_and_match_eager():
    cap = capture(TinyDecoder(soft_capped(0.5)), **model_kwargs())
    result = lower(cap.fresh())
    assert [(s.softcap, s.scale) for s in result.sites] == [(0.5, 2.0)] * 2
    assert {tuple(n.args[-2:]) for n in lowered_ops(result.gm)} == {(None, 0.5)}
    assert not any("tanh" in str(n.target) for n in result.gm.graph.nodes)
    steps_against_eager(cap, result, [[[3, 5, 7, 11, 2], [13, 17]], [[19], [23, 29, 31]], [[41, 43], [47]]])
    uncapped = TinyDecoder(soft_capped(1e6))
    uncapped.load_state_dict(cap.model.state_dict())
    seq = [3, 5, 7, 11, 2]
    assert (eager_last_logits(uncapped, seq) - eager_last_logits(cap.model, seq)).abs().max() > 0.1  # the cap bites


@pytest.mark.parametrize(("attn", "names"), [
    (soft_capped(mask_first=True), ("mask", "before", "soft-cap 'tanh'")),
    (soft_capped(scale_after=True), ("scaled", "after", "soft-cap 'tanh'")),
], ids=["mask_first", "scale_after"])
def test_soft_caps_that_change_the_mask_or_scale_are_refused(attn, names):
    gm = capture(TinyDecoder(attn), **model_kwargs()).fresh()
    with raises_naming(LoweringError, *names):
        find_attention.run(gm)


# -- attention forms that must be refused --
def tanh_without_a_cap(q, k, v):
    scores = torch.tanh(q @ repeat_kv(k, 2).transpose(-2, -1)).masked_fill(~causal_bool(q.shape[2]), float("-inf"))
    return torch.softmax(scores, dim=-1) @ repeat_kv(v, 2)


def alibi(q, k, v):
    i = torch.arange(q.shape[2])
    bias = -0.5 * (i[:, None] - i[None, :]).float()
    bias = bias.masked_fill(~causal_bool(q.shape[2]), float("-inf"))
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=bias)


def bidirectional(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))


def explicit_without_mask(q, k, v):
    return torch.softmax(q @ repeat_kv(k, 2).transpose(-2, -1), dim=-1) @ repeat_kv(v, 2)


def weights_used_twice(q, k, v):
    scores = (q @ repeat_kv(k, 2).transpose(-2, -1)).masked_fill(~causal_bool(q.shape[2]), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights @ repeat_kv(v, 2) + weights[..., :1]


def training_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True, dropout_p=0.1)


REFUSED = {
    tanh_without_a_cap: ("tanh", "soft-cap"),
    alibi: ("bias -0.5", "token 1", "token 0", "(ALiBi"),
    bidirectional: ("is_causal=False", "attn_mask"),
    explicit_without_mask: ("no mask", "scores", "softmax"),
    weights_used_twice: ("attention weights 'weights'",),
    training_dropout: ("dropout_p=0.1",),
}


@pytest.mark.parametrize("attn", list(REFUSED), ids=lambda f: f.__name__)
def test_refused_forms_name_the_node_target_and_line(attn):
    gm = capture(TinyDecoder(attn), **model_kwargs()).fresh()
    with raises_naming(LoweringError, *REFUSED[attn]) as info:
        find_attention.run(gm)
    message = str(info.value)
    assert "node '" in message and "test_find_attention.py:" in message
    assert "scaled_dot_product_attention" in message or "softmax" in message or "matmul" in message


class CrossAttention(nn.Module):
    """Q from the tokens, K/V from another graph input (encoder states)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, 32)
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, input_ids, position_ids, enc):
        x = self.wte(input_ids)
        T, S = x.shape[1], enc.shape[1]
        q = self.q(x).view(1, T, 4, 8).transpose(1, 2)
        k, v = (t.view(1, S, 4, 8).transpose(1, 2) for t in self.kv(enc).split(32, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("enc_len", [4, 6], ids=["other_length", "same_length"])
def test_cross_attention_is_refused(enc_len):
    gm = capture(CrossAttention(), enc=torch.randn(1, enc_len, 32), **model_kwargs(6)).fresh()
    with pytest.raises(LoweringError, match="cross-attention"):
        find_attention.run(gm)


class UnmaskedCrossAttention(CrossAttention):
    """The same, without a mask and not causal: what a one-token graph of HF's SDPA path looks like."""

    def forward(self, input_ids, position_ids, enc):
        x = self.wte(input_ids)
        T, S = x.shape[1], enc.shape[1]
        q = self.q(x).view(1, T, 4, 8).transpose(1, 2)
        k, v = (t.view(1, S, 4, 8).transpose(1, 2) for t in self.kv(enc).split(32, dim=-1))
        return F.scaled_dot_product_attention(q, k, v)


def test_one_token_cross_attention_without_a_mask_is_still_refused():
    """One query over one key passes for causal (``T == 1``), but only over the token's own K/V."""
    gm = capture(UnmaskedCrossAttention(), enc=torch.randn(1, 1, 32), **model_kwargs(1)).fresh()
    with pytest.raises(LoweringError, match="cross-attention"):
        find_attention.run(gm)


def test_padding_mask_input_is_refused():
    cap = capture(tiny_qwen2("sdpa"), attention_mask=torch.ones(1, 6, dtype=torch.long), **hf_kwargs())
    with raises_naming(LoweringError, "graph input 'l_kwargs_attention_mask_'"):
        find_attention.run(cap.fresh())


@pytest.mark.parametrize("window", [4, 4096])
def test_hf_sliding_window_lowers_with_the_models_width(window):
    """Mistral's mask (HF's own mask functions) is a window of ``sliding_window`` tokens; the
    default 4096 is checked at 4097 tokens."""
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=window, attn_implementation="sdpa")).eval()
    cap = capture(model, **hf_kwargs())
    result = lower(cap.fresh())
    assert [s.sliding_window for s in result.sites] == [window]
    assert result.sites[0].mask[0].max_tokens == max(window + 1, 8)
    steps_against_eager(cap, result, [[[3, 5, 7, 11, 2, 9], [13, 17]], [[19], [23, 29, 31]], [[41], [47]]])


def test_static_capture_lowers_for_its_token_count():
    model = TinyDecoder(sdpa_bool_mask)
    cap = capture(model, dynamic=False, **model_kwargs(7))
    gm = cap.fresh()
    result = lower(gm)
    assert result.sites[0].mask_text == "mask proven causal at 1 token counts up to 7"
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    logits = run_step(gm, cap, RaggedCache(result.params, batch=2), seqs)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-5, rtol=0)


def test_static_capture_of_a_causal_buffer_lowers():
    """A static graph reads only [:T, :T] of nanoGPT's buffer; the whole buffer is a causal table."""
    model = NanoGPT(VOCAB)
    cap = capture(model, dynamic=False, **model_kwargs(7))
    gm = cap.fresh()
    result = lower(gm, example_inputs=cap.example_inputs)
    seqs = [[1, 2, 3, 4, 5], [6, 7]]
    logits = run_step(gm, cap, RaggedCache(result.params, batch=2), seqs)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-5, rtol=0)


def test_static_capture_of_a_banded_buffer_is_refused():
    """A window of 10 does not show at the 7 tokens a static graph can be evaluated at: the buffer
    tells; captured with a dynamic token count, the window is found and lowered."""
    model = NanoGPT(VOCAB)
    for block in model.h:
        block.attn.bias.copy_(block.attn.bias * torch.ones_like(block.attn.bias).triu(-9))
    cap = capture(model, dynamic=False, **model_kwargs(7))
    with raises_naming(LoweringError, "7 tokens", "size 32", "dynamic=True"):
        find_attention.run(cap.fresh(), cap.example_inputs)
    dynamic = capture(model, **model_kwargs(7))
    result = lower(dynamic.fresh(), example_inputs=dynamic.example_inputs)
    assert [s.sliding_window for s in result.sites] == [10, 10]
    steps_against_eager(dynamic, result, [[list(range(1, 13)), [5, 6]], [[13], [7, 8, 9, 10, 11, 12, 13, 14, 15]]])


def shown_windows(*sizes: int | None) -> KnownWindows:
    return KnownWindows(sizes=sizes, origin=WindowOrigin.SEVERAL_TOKENS)


def test_a_dynamic_graph_must_show_the_windows_given_for_it():
    """Windows known up front (a config) are checked wherever a graph can show them."""
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa")).eval()
    several = capture(model, **hf_kwargs())
    config = KnownWindows(sizes=(3,), origin=WindowOrigin.CONFIG)
    assert [s.sliding_window for s in lower(several.fresh(), windows=config).sites] == [3]
    with raises_naming(LoweringError, "sliding window of 3 tokens", "model's config", "window of 4"):
        lower(several.fresh(), windows=KnownWindows(sizes=(4,), origin=WindowOrigin.CONFIG))


def test_fixed_size_graph_takes_the_windows_of_the_models_dynamic_graph():
    """Dynamo captures T == 1 as a graph of its own: one token shows no window, so its sites take
    the windows the several-token graph proved, and refuse without them."""
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa")).eval()
    one = capture(model, dynamic=False, **hf_kwargs(1))
    with raises_naming(LoweringError, "1 tokens", "size 3", "sliding window"):
        lower(one.fresh())
    result = lower(one.fresh(), windows=shown_windows(3, 3))
    assert [s.sliding_window for s in result.sites] == [3, 3]
    assert result.sites[0].mask[-1] == WindowTaken(window=3, origin=WindowOrigin.SEVERAL_TOKENS)
    assert result.sites[0].mask_text.endswith("sliding window of 3 tokens from the model's graph of several tokens")
    with raises_naming(LoweringError, "2 attention sites", "model's graph of several"):
        lower(one.fresh(), windows=shown_windows(3))
    # decode steps over a cache filled by the several-token graph
    several = capture(model, **hf_kwargs())
    prefill = lower(several.fresh())
    cache = RaggedCache(prefill.params, batch=1, max_len=32)
    seq = [3, 5, 7, 11, 2]
    run_step(prefill.gm, several, cache, [seq])
    for token in (29, 31, 37):
        logits = run_step(result.gm, one, cache, [[token]])
        seq.append(token)
        torch.testing.assert_close(logits[0, 0], eager_last_logits(model, seq), atol=1e-5, rtol=0)


def test_positions_computed_inside_the_graph_are_refused():
    """Without position_ids, HF computes arange(T) positions in the graph: wrong for a ragged step."""
    kwargs = hf_kwargs()
    del kwargs["position_ids"]
    gm = capture(tiny_llama("sdpa"), **kwargs).fresh()
    with raises_naming(LoweringError, "token positions", "node 'arange'", "modeling_llama.py:",
                       "position_ids = torch.arange"):
        find_attention.run(gm)


def scores_used_twice(q, k, v):
    scores = (q @ repeat_kv(k, 2).transpose(-2, -1)).masked_fill(~causal_bool(q.shape[2]), float("-inf"))
    return torch.softmax(scores, dim=-1) @ repeat_kv(v, 2) + scores.amax(-1, keepdim=True)


def test_scores_used_outside_attention_are_refused():
    gm = capture(TinyDecoder(scores_used_twice), **model_kwargs()).fresh()
    with raises_naming(LoweringError, "attention scores 'scores'", "softmax, amax"):

        find_attention.run(gm)
