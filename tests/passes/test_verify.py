"""dce removes the mask subgraph; verify rejects graphs with attention left or KV inputs misused."""

from __future__ import annotations

import pytest
import torch
from lowering_helpers import count_calls

from kvgraph.errors import LoweringError
from kvgraph.params import KVCacheParams
from kvgraph.passes import add_kv_inputs, find_attention, lower_attention, verify
from kvgraph.passes.add_kv_inputs import graph_fake_mode
from kvgraph.passes.graph_view import placeholder_kind


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
    with pytest.raises(LoweringError, match="KV placeholder 'kv_blocks' is unused"):
        verify.run(gm, analysis, kv)


def test_duplicate_layer_index_fails_verification(llama_eager):
    gm, analysis, kv = prepared(llama_eager)
    calls = lower_attention.run(gm, analysis.sites, kv)
    calls[1].update_arg(8, 0)
    verify.dce(gm)
    with pytest.raises(LoweringError, match=r"layer_idx of the 2 ragged_attention calls are \[0, 0\]"):
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
    with pytest.raises(LoweringError, match="un-lowered softmax over tokens node 'softmax"):
        verify.run(gm, analysis, kv)
