"""dce removes the mask subgraph; verify rejects graphs with attention left or KV inputs misused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgraph.cache.params import KVCacheParams
from kvgraph.errors import LoweringError
from kvgraph.passes import add_kv_inputs, find_attention, lower, lower_attention, verify
from kvgraph.passes.add_kv_inputs import graph_fake_mode
from kvgraph.passes.graph_view import placeholder_kind
from tests.naming import raises_naming
from tests.passes.lowering_helpers import (
    RaggedCache,
    TinyDecoder,
    capture,
    count_calls,
    eager_last_logits,
    model_kwargs,
    run_step,
)


def prepared(captured):
    gm = captured.fresh()
    analysis = find_attention.run(gm)
    params = KVCacheParams(analysis.dtype, analysis.n_kv_heads, analysis.head_dim, analysis.num_layers)
    return gm, analysis, add_kv_inputs.run(gm, params)


def test_dce_removes_the_mask_subgraph_and_old_attention(llama_sdpa):
    gm, analysis, kv = prepared(llama_sdpa)
    lower_attention.run(gm, analysis.sites, kv)
    removed = verify.dce(gm)
    alive = set(gm.graph.nodes)
    assert analysis.mask_nodes and not analysis.mask_nodes & alive
    assert removed >= len(analysis.mask_nodes) + len(analysis.sites)
    assert count_calls(gm, "scaled_dot_product", "arange", "cumsum", "diff") == 0
    assert len(gm.graph.find_nodes(op="placeholder")) == len(llama_sdpa.gm.graph.find_nodes(op="placeholder")) + 5
    verify.run(gm, analysis, kv)


def test_unlowered_site_fails_verification(llama_sdpa):
    gm, analysis, kv = prepared(llama_sdpa)
    lower_attention.run(gm, analysis.sites[:1], kv)
    verify.dce(gm)
    with pytest.raises(LoweringError) as info:
        verify.run(gm, analysis, kv)
    message = str(info.value)
    assert "un-lowered attention node 'attn_output_5'" in message
    assert "layer_idx of the 1 ragged_attention calls are [0], expected 0..1" in message
    assert "mask-building nodes survived lowering" in message


def test_unused_kv_placeholders_fail_verification(llama_sdpa):
    gm, analysis, kv = prepared(llama_sdpa)
    with raises_naming(LoweringError, "KV placeholder 'kv_blocks'", "unused"):
        verify.run(gm, analysis, kv)


def test_duplicate_layer_index_fails_verification(llama_eager):
    gm, analysis, kv = prepared(llama_eager)
    calls = lower_attention.run(gm, analysis.sites, kv)
    calls[1].update_arg(8, 0)
    verify.dce(gm)
    with raises_naming(LoweringError, "layer_idx", "2 ragged_attention calls", "[0, 0]"):
        verify.run(gm, analysis, kv)


def test_softmax_over_tokens_left_fails_verification(llama_eager):
    gm, analysis, kv = prepared(llama_eager)
    lower_attention.run(gm, analysis.sites, kv)
    verify.dce(gm)
    T = analysis.token_count
    size = next(n for n in gm.graph.find_nodes(op="placeholder") if placeholder_kind(n) == "size")
    with gm.graph.inserting_before(gm.graph.output_node()):
        scores = gm.graph.call_function(torch.ones, (size, size))
        weights = gm.graph.call_function(torch.softmax, (scores, -1))
    with graph_fake_mode(gm):
        scores.meta["example_value"] = torch.ones(T, T)
        weights.meta["example_value"] = torch.softmax(scores.meta["example_value"], -1)
    with raises_naming(LoweringError, "un-lowered softmax", "call_function torch.softmax"):

        verify.run(gm, analysis, kv)


class InPlace(TinyDecoder):
    """Mutates hidden states in place with an unused result: DCE must keep it."""

    def features(self, input_ids, position_ids):
        x = super().features(input_ids, position_ids)
        x.mul_(2.0)
        return x


def test_dce_keeps_in_place_ops():
    model = InPlace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    cap = capture(model, **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method" and n.target == "mul_"] == ["mul_"]
    seqs = [[1, 2, 3], [4, 5]]
    logits = run_step(gm, cap, RaggedCache(result.params, batch=2), seqs)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-5, rtol=0)


def in_place_ops(x):
    y = x * 2
    y += 1
    z = y * 3
    z.add_(1)
    torch.relu_(z)
    return (y > 0) & (z > 0), y, z


def test_side_effects_are_in_place_ops():
    gm = capture(in_place_ops, x=torch.randn(3)).gm
    effects = {n.name: verify.has_side_effects(n) for n in gm.graph.nodes if n.op.startswith("call")}
    assert effects == {"y": False, "y_1": True, "z": False, "add_": True, "relu_": True,
                       "gt": False, "gt_1": False, "and_": False}
