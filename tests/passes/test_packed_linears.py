"""packed_linears: every float32 linear layer of a CPU graph runs as ``kvgraph::linear``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvgraph.passes import lower, packed_linears
from tests.passes.lowering_helpers import (
    TinyDecoder,
    capture,
    count_calls,
    model_kwargs,
    steps_against_eager,
)


def causal(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)


def _linears(module: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in module.modules())


def _packed(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.kvgraph.linear.default for n in gm.graph.nodes)


def _plain(gm: torch.fx.GraphModule) -> int:
    return count_calls(gm, "linear") - _packed(gm)


def test_every_linear_of_a_hf_model_is_packed(llama_sdpa):
    gm = llama_sdpa.fresh()
    result = lower(gm)
    assert _packed(gm) == _linears(llama_sdpa.model) > 0
    assert _plain(gm) == 0
    assert result.timings["packed_linears"] >= 0


def test_packed_graph_computes_what_eager_does():
    cap = capture(TinyDecoder(causal), **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert _packed(gm) == _linears(cap.model)
    steps_against_eager(cap, result, [[[3, 5, 7], [11, 2]], [[13], [17, 19, 23]], [[29], [31]]], atol=1e-4)


def test_disabled_leaves_f_linear(llama_sdpa):
    gm = llama_sdpa.fresh()
    lower(gm, packed_linears=False)
    assert _packed(gm) == 0
    assert _plain(gm) == _linears(llama_sdpa.model)


def test_a_bfloat16_model_keeps_f_linear():
    cap = capture(TinyDecoder(causal).to(torch.bfloat16), **model_kwargs())
    gm = cap.fresh()
    lower(gm)
    assert _packed(gm) == 0
    assert _plain(gm) == _linears(cap.model)


class ComputedWeight(TinyDecoder):
    """A head whose weight is computed in the forward pass: no constant to pack once."""

    def forward(self, input_ids, position_ids):
        x = self.features(input_ids, position_ids)
        return F.linear(x, self.head.weight * 2.0, self.head.bias)


def test_a_computed_weight_keeps_f_linear():
    cap = capture(ComputedWeight(causal), **model_kwargs())
    gm = cap.fresh()
    lower(gm)
    assert _plain(gm) == 1  # the head; the blocks' linears are packed
    assert _packed(gm) == _linears(cap.model) - 1


def test_run_counts_what_it_rewrote(llama_sdpa):
    gm = llama_sdpa.fresh()
    assert packed_linears.run(gm, enabled=False) == 0
    assert packed_linears.run(gm) == _linears(llama_sdpa.model)
    assert packed_linears.run(gm) == 0  # nothing left to rewrite
