"""prune_logits: the vocabulary projection runs on each sequence's last token only."""

from __future__ import annotations

import pytest
import torch

from kvgraph.errors import LoweringError
from kvgraph.passes import lower, prune_logits
from kvgraph.passes.graph_view import meta_value
from tests.naming import raises_naming
from tests.passes.lowering_helpers import (
    VOCAB,
    RaggedCache,
    TinyDecoder,
    capture,
    count_calls,
    eager_last_logits,
    graph_args,
    model_kwargs,
    run_step,
)


def causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)


class Variant(TinyDecoder):
    """TinyDecoder whose output is post-processed: ``last*`` keep only the last token (nanoGPT's
    inference path, HF's ``logits_to_keep=1``, an index), ``softcap`` caps the logits with tanh,
    ``hidden`` returns hidden states."""

    def __init__(self, kind: str) -> None:
        super().__init__(causal)
        self.kind = kind

    def forward(self, input_ids, position_ids):
        x = self.features(input_ids, position_ids)  # [1, T, C]
        if self.kind == "last":
            return self.head(x[:, [-1], :])
        if self.kind == "last_slice":
            return self.head(x[:, -1:])
        if self.kind == "last_index":
            return self.head(x[:, -1, :])  # [1, V]
        if self.kind == "softcap":
            return torch.tanh(self.head(x) / 30.0) * 30.0
        return x


def test_hf_logits_become_one_row_per_logit_position(llama_sdpa):
    gm = llama_sdpa.fresh()
    result = lower(gm)
    assert result.logits_pruned
    assert result.kv_placeholders[-2:] == ["input_row_offsets", "logit_positions"]
    logits = gm.graph.output_node().args[0][0]
    (positions,) = gm.graph.find_nodes(op="placeholder", target="logit_positions")
    rows = meta_value(positions)
    assert rows.dtype == torch.int32 and rows.dim() == 1
    shape = meta_value(logits).shape
    assert shape[0] == 1 and shape[1].node.expr == rows.shape[0].node.expr and shape[2] == VOCAB
    assert count_calls(gm, "index_select") == 1
    # on the CPU the pruned projection, like every float32 linear, is then packed (packed_linears)
    projection = logits.args[0] if logits.op == "call_function" and "linear" not in str(logits.target) else logits
    assert projection.target is torch.ops.kvgraph.linear.default
    assert projection.args[0].target is torch.index_select or projection.args[0].args[0].target is torch.index_select


def test_the_pass_leaves_the_projection_a_plain_linear(llama_sdpa):
    gm = llama_sdpa.fresh()
    result = lower(gm)
    assert result.logits_pruned
    plain = llama_sdpa.fresh()
    from kvgraph.passes import add_kv_inputs, find_attention, lower_attention

    analysis = find_attention.run(plain, None)
    kv = add_kv_inputs.run(plain, result.params)
    lower_attention.run(plain, analysis.sites, kv)
    assert prune_logits.run(plain, kv.input_row_offsets, analysis.token_count, True)
    assert count_calls(plain, "linear.default") == 0
    (logits,) = plain.graph.output_node().args[0][:1]
    assert logits.target is torch._C._nn.linear


@pytest.mark.parametrize("kind", ["last", "last_slice", "last_index", "softcap"])
def test_pruned_variants_match_eager_per_sequence(kind):
    model = Variant(kind)
    cap = capture(model, **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert result.logits_pruned
    seqs = [[3, 5, 7], [11, 13], [17, 19, 23, 29]]
    logits = run_step(gm, cap, RaggedCache(result.params, batch=3), seqs)
    logits = logits[None] if kind == "last_index" else logits  # x[:, -1] gives [batch, V]
    assert logits.shape == (1, 3, VOCAB)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-5, rtol=0)


def test_logit_positions_pick_any_rows_of_the_step(llama_sdpa):
    """The rows are an input: every prompt position of one sequence and the last of another,
    from the graph that serves ordinary steps."""
    gm = llama_sdpa.fresh()
    result = lower(gm)
    seqs = [[3, 5, 7, 9], [11, 13, 17]]
    cache = RaggedCache(result.params, batch=2)
    wanted = [0, 1, 2, 3, 6]
    tensors = {
        "input_ids": torch.tensor([t for s in seqs for t in s])[None],
        "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2])[None],
        **cache.step_inputs([4, 3]),
        "logit_positions": torch.tensor(wanted, dtype=torch.int32),
    }
    with torch.no_grad():
        logits = gm(*graph_args(gm, llama_sdpa, tensors))[0]
    assert logits.shape == (1, len(wanted), VOCAB)
    for row, (seq, upto) in enumerate([(0, 1), (0, 2), (0, 3), (0, 4), (1, 3)]):
        expected = eager_last_logits(llama_sdpa.model, seqs[seq][:upto])
        torch.testing.assert_close(logits[0, row], expected, atol=1e-5, rtol=0)


def test_last_token_only_graph_without_pruning_is_refused():
    gm = capture(Variant("last"), **model_kwargs()).fresh()
    with raises_naming(LoweringError, "last token's logits", "prune_logits=True"):

        lower(gm, prune_logits=False)


def test_output_without_a_final_linear_is_not_pruned():
    cap = capture(Variant("hidden"), **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert not result.logits_pruned
    assert prune_logits.find_logits(gm, result.sites[0].q.meta["example_value"].shape[2]) == []


def test_disabled_pruning_keeps_every_token(llama_sdpa):
    gm = llama_sdpa.fresh()
    result = lower(gm, prune_logits=False)
    assert not result.logits_pruned and count_calls(gm, "index_select") == 0
    logits = gm.graph.output_node().args[0][0]
    assert meta_value(logits).shape[1].node.expr == meta_value(result.sites[0].q).shape[2].node.expr


def test_a_quantized_projection_keeps_f_linear_and_runs_on_the_last_tokens():
    """A tensor-subclass weight (torchao's int8) implements F.linear, not kvgraph::linear."""
    from kvgraph.engine.quantization import quantize

    model = TinyDecoder(causal).to(torch.bfloat16)
    quantize(model, "int8-weight-only", lm_head=True)
    cap = capture(model, **model_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert result.logits_pruned
    assert count_calls(gm, "linear.default") == 0  # kvgraph::linear
    seqs = [[3, 5, 7], [11, 13]]
    logits = run_step(gm, cap, RaggedCache(result.params, batch=2), seqs)
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=2e-2, rtol=0)
