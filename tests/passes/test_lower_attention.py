"""lower_attention: each site becomes one ragged_attention call on un-repeated [T, H, D] K/V."""

from __future__ import annotations

import operator

import pytest
import torch

from kvgraph.cache.params import KVCacheParams
from kvgraph.passes import add_kv_inputs, find_attention, lower_attention
from kvgraph.passes.graph_view import meta_value
from tests.passes.lowering_helpers import lowered_ops


def lowered(captured):
    gm = captured.fresh()
    analysis = find_attention.run(gm, captured.example_inputs)
    params = KVCacheParams(analysis.dtype, analysis.n_kv_heads, analysis.head_dim, analysis.num_layers)
    kv = add_kv_inputs.run(gm, params)
    calls = lower_attention.run(gm, analysis.sites, kv)
    return gm, analysis, kv, calls


def test_one_call_per_site_in_execution_order(llama_sdpa):
    gm, analysis, kv, calls = lowered(llama_sdpa)
    assert calls == lowered_ops(gm)
    assert [c.args[8] for c in calls] == [0, 1]
    for call, site in zip(calls, analysis.sites, strict=True):
        assert tuple(call.args[3:8]) == kv.op_args()
        assert call.args[9] == site.scale == 1.0  # HF's run-time scaling is folded into q
        assert not site.node.users  # the SDPA call is left for dce


def test_operands_are_token_major_and_kv_un_repeated(llama_sdpa):
    gm, analysis, kv, calls = lowered(llama_sdpa)
    call, site = calls[0], analysis.sites[0]
    q, k, v = (meta_value(a) for a in call.args[:3])
    T = meta_value(site.q).shape[2]
    assert (q.shape[0].node.expr, *q.shape[1:]) == (T.node.expr, 4, 16)
    assert (k.shape[0].node.expr, *k.shape[1:]) == (T.node.expr, 2, 16)
    assert tuple(v.shape[1:]) == (2, 16)
    out = meta_value(call)
    assert out.shape[1:] == (4, 16) and out.dtype == torch.float32
    # k reaches the op from the un-repeated key, through squeeze and transpose only
    transpose = call.args[1]
    assert transpose.target is torch.transpose and transpose.args[0].target is torch.squeeze
    assert transpose.args[0].args[0] is site.k


def test_runtime_scale_is_folded_into_q(llama_sdpa):
    gm, analysis, kv, calls = lowered(llama_sdpa)
    site = analysis.sites[0]
    (name, factor), = site.scale_factors
    assert name == "mul" and factor.target == "item"
    squeeze = calls[0].args[0].args[0]
    scaled = squeeze.args[0]
    assert scaled.target is operator.mul and scaled.args == (site.q, factor)


def test_explicit_pattern_constant_scale_goes_to_the_op(nanogpt):
    gm, analysis, kv, calls = lowered(nanogpt)
    assert [c.args[9] for c in calls] == [pytest.approx(8 ** -0.5)] * 2
    assert all(s.scale_factors == () for s in analysis.sites)


def test_site_output_is_back_in_the_model_layout(llama_eager):
    gm, analysis, kv, calls = lowered(llama_eager)
    for call in calls:
        (transpose,) = call.users
        (unsqueeze,) = transpose.users
        assert unsqueeze.target is torch.unsqueeze
        assert meta_value(unsqueeze).shape[:2] == (1, 4) and meta_value(unsqueeze).shape[3] == 16
