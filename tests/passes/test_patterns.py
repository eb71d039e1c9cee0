"""Node patterns: un-repeating K/V (only when head h reads kv head h // n), transposes, dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgraph.passes import patterns as P
from tests.passes.lowering_helpers import capture


def output_of(fn, **kwargs) -> torch.fx.Node:
    gm = capture(fn, **kwargs).gm
    return gm.graph.output_node().args[0][0]


def k_input() -> dict:
    return {"k": torch.randn(1, 2, 5, 8)}


def hf_repeat(k):
    b, h, t, d = k.shape
    return k[:, :, None, :, :].expand(b, h, 3, t, d).reshape(b, h * 3, t, d)


def unsqueeze_flatten(k):
    return k.unsqueeze(2).expand(-1, -1, 3, -1, -1).flatten(1, 2)


def interleave(k):
    return torch.repeat_interleave(k, 3, dim=1)


def tiled(k):
    return k.repeat(1, 3, 1, 1)  # head h reads kv head h % Hkv: not GQA's grouping


def expand_outer(k):
    b, h, t, d = k.shape
    return k[:, None].expand(b, 3, h, t, d).reshape(b, 3 * h, t, d)  # also h % Hkv


@pytest.mark.parametrize(("fn", "how"), [
    (hf_repeat, P.KVRepeat.EXPAND_RESHAPE), (unsqueeze_flatten, P.KVRepeat.EXPAND_RESHAPE),
    (interleave, P.KVRepeat.REPEAT_INTERLEAVE),
    (tiled, None), (expand_outer, None),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_unrepeat_kv_only_undoes_grouped_repeats(fn, how):
    out = output_of(fn, **k_input())
    found = P.unrepeat_kv(out)
    assert found.how == how
    if how is None:
        assert found.node is out
    else:
        assert found.node.op == "placeholder" and P.shape(found.node)[1] == 2


@pytest.mark.parametrize(("fn", "matches"), [
    (lambda k: k.transpose(-2, -1), True),
    (lambda k: k.transpose(3, 2), True),
    (lambda k: k.permute(0, 1, 3, 2), True),
    (lambda k: k.transpose(1, 2), False),
    (lambda k: k.permute(0, 2, 1, 3), False),
])
def test_strip_transpose_last2(fn, matches):
    out = output_of(fn, **k_input())
    assert (P.strip_transpose_last2(out) is not None) == matches


@pytest.mark.parametrize(("fn", "identity"), [
    (lambda x: F.dropout(x, p=0.3, training=False), True),
    (lambda x: F.dropout(x, p=0.0, training=True), True),
    (lambda x: F.dropout(x, p=0.3, training=True), False),
])
def test_identity_dropout(fn, identity):
    out = output_of(fn, x=torch.randn(3, 3))
    assert P.is_identity_dropout(out) == identity


def test_sdpa_args_fill_defaults():
    out = output_of(lambda q: F.scaled_dot_product_attention(q, q, q, None, 0.0, True), q=torch.randn(1, 2, 4, 8))
    assert P.is_sdpa(out)
    args = P.sdpa_args(out)
    assert args["is_causal"] is True and args["attn_mask"] is None and args["scale"] is None
    assert args["enable_gqa"] is False
