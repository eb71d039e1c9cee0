"""The whole lowering pipeline on captured models: numerics against eager, graph shape, options."""

from __future__ import annotations

import logging

import pytest
import torch

from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.errors import InvalidParamsError, LoweringError
from kvgraph.passes import lower
from kvgraph.passes.patterns import KVRepeat
from kvgraph.passes.pipeline import PASSES, LoweringPipeline
from tests.passes.lowering_helpers import (
    VOCAB,
    RaggedCache,
    TinyDecoder,
    capture,
    count_calls,
    eager_last_logits,
    hf_kwargs,
    lowered_ops,
    run_step,
    tiny_llama,
)

MODELS = ["llama_sdpa", "llama_eager", "gpt2_sdpa", "qwen2_sdpa", "nanogpt"]
ATOL = 1e-4


def prompts(*lengths: int, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
@pytest.mark.parametrize("model", MODELS)
def test_ragged_prefill_then_decode_matches_eager(model, strategy, request):
    """Two sequences prefilled together (ragged), then steps of 1 and 2 new tokens over the cache."""
    cap = request.getfixturevalue(model)
    gm = cap.fresh()
    result = lower(gm, cache_strategy=strategy, page_size=4, example_inputs=cap.example_inputs)
    cache = RaggedCache(result.params, batch=2)
    seqs = prompts(5, 3)
    step_tokens = [seqs, [[7], [9]], [[11], [13, 17]]]
    for step in step_tokens:
        if step is not seqs:
            for s, new in zip(seqs, step, strict=True):
                s.extend(new)
        logits = run_step(gm, cap, cache, step)  # [1, batch, V]
        assert logits.shape == (1, 2, VOCAB)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, b], eager_last_logits(cap.model, s), atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_cuda_graph_lowers_onto_a_cuda_cache(strategy):
    """On CUDA the op runs the Triton kernels: ragged prefill and a decode step against eager."""
    model = tiny_llama("sdpa").cuda()
    cap = capture(model, **hf_kwargs(device="cuda"))
    gm = cap.fresh()
    result = lower(gm, cache_strategy=strategy, page_size=4)
    assert result.params.device.type == "cuda"
    cache = RaggedCache(result.params, batch=2)
    seqs = prompts(6, 3)
    for step in (seqs, [[7], [9]]):
        if step is not seqs:
            for s, new in zip(seqs, step, strict=True):
                s.extend(new)
        logits = run_step(gm, cap, cache, step)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-3, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_single_sequence_prefill_matches_eager(model, request):
    cap = request.getfixturevalue(model)
    gm = cap.fresh()
    result = lower(gm, example_inputs=cap.example_inputs)
    (tokens,) = prompts(9, seed=5)
    logits = run_step(gm, cap, RaggedCache(result.params, batch=1), [tokens])
    torch.testing.assert_close(logits[0, 0], eager_last_logits(cap.model, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_lowered_graph_has_one_op_per_layer_and_no_attention_left(model, request):
    cap = request.getfixturevalue(model)
    before = (count_calls(cap.gm, "scaled_dot_product"), count_calls(cap.gm, "softmax"))
    gm = cap.fresh()
    result = lower(gm, example_inputs=cap.example_inputs)
    assert before in ((2, 0), (0, 2))
    assert count_calls(gm, "scaled_dot_product", "softmax") == 0
    ops = lowered_ops(gm)
    assert [op.args[8] for op in ops] == [0, 1]
    assert [s.layer_idx for s in result.sites] == [0, 1]
    assert [s.node.name for s in result.sites] == [
        n.name for n in cap.gm.graph.nodes if n.name in {s.node.name for s in result.sites}]
    assert result.lowered and result.reason is None and result.logits_pruned
    assert result.params.num_layers == 2
    assert set(result.timings) == set(PASSES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_gets_a_half_precision_cache(dtype):
    model = tiny_llama("sdpa").to(dtype)
    cap = capture(model, **hf_kwargs())
    gm = cap.fresh()
    result = lower(gm)
    assert result.params.dtype == dtype and gm.graph.find_nodes(
        op="placeholder", target="kv_blocks")[0].meta["val"].dtype == dtype
    seqs = prompts(5, 3)
    logits = run_step(gm, cap, RaggedCache(result.params, batch=2), seqs)
    assert logits.dtype == dtype
    for b, s in enumerate(seqs):
        torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-2, rtol=0)


def test_params_inferred_from_llama_gqa(llama_sdpa):
    result = lower(llama_sdpa.fresh(), cache_strategy="continuous", page_size=None)
    assert result.params == KVCacheParams(
        dtype=torch.float32, n_kv_heads=2, head_dim=16, num_layers=2, page_size=None,
        cache_strategy=KVCacheStrategy.CONTINUOUS, device="cpu",
    )
    assert [s.repeat for s in result.sites] == [KVRepeat.EXPAND_RESHAPE] * 2
    assert [s.n_heads for s in result.sites] == [4, 4]


def test_kv_placeholders_come_last_in_order_with_symbolic_fake_types(llama_sdpa):
    gm = llama_sdpa.fresh()
    n_before = len(gm.graph.find_nodes(op="placeholder"))
    result = lower(gm, page_size=8)
    placeholders = gm.graph.find_nodes(op="placeholder")
    added = placeholders[n_before:]
    assert [n.name for n in added] == result.kv_placeholders == [
        "kv_blocks", "cache_lengths", "lookup_table", "max_lengths", "input_row_offsets", "logit_positions"]
    vals = {n.name: n.meta["val"] for n in added}
    blocks = vals["kv_blocks"]
    assert blocks.dtype == torch.float32 and tuple(blocks.shape[1:]) == (2, 2, 8, 2, 16)
    assert isinstance(blocks.shape[0], torch.SymInt)
    batch = vals["cache_lengths"].shape[0]
    assert isinstance(batch, torch.SymInt)
    assert vals["lookup_table"].shape[0] is batch or vals["lookup_table"].shape[0].node.expr == batch.node.expr
    assert isinstance(vals["lookup_table"].shape[1], torch.SymInt)
    assert (vals["input_row_offsets"].shape[0] - 1).node.expr == batch.node.expr
    assert tuple(vals["max_lengths"].shape[1:]) == (2,) and vals["max_lengths"].device.type == "cpu"
    for name in ("cache_lengths", "lookup_table", "max_lengths", "input_row_offsets", "logit_positions"):
        assert vals[name].dtype == torch.int32, name
    rows = vals["logit_positions"].shape[0]  # a size of its own: a step may want more rows than sequences
    assert isinstance(rows, torch.SymInt) and rows.node.expr != batch.node.expr
    assert list(result.symbols.names()) == result.kv_placeholders[:4]


def test_dump_sees_every_stage(llama_sdpa):
    stages = []
    lower(llama_sdpa.fresh(), dump=lambda stage, gm: stages.append((stage, len(lowered_ops(gm)))))
    assert [s for s, _ in stages] == ["captured", *PASSES]
    assert dict(stages)["captured"] == 0 and dict(stages)["lower_attention"] == 2


def test_expected_params_that_disagree_raise_naming_both_sides(llama_sdpa):
    expected = KVCacheParams(dtype=torch.float16, n_kv_heads=4, head_dim=16, num_layers=2)
    gm = llama_sdpa.fresh()
    code = gm.code
    with pytest.raises(LoweringError, match=r"n_kv_heads: graph 2 vs cache 4.*dtype: graph torch.float32 vs cache torch.float16"):
        lower(gm, expected=expected)
    assert gm.code == code


def test_expected_params_that_agree_are_used(llama_sdpa):
    expected = KVCacheParams(dtype=torch.float32, n_kv_heads=2, head_dim=16, num_layers=2, page_size=32,
                             enable_prefix_caching=True)
    result = lower(llama_sdpa.fresh(), expected=expected, page_size=16)
    assert result.params is expected
    assert result.symbols.kv_blocks.shape[3] == 32


def test_bad_page_size_is_a_caller_error_even_when_not_strict(llama_sdpa):
    with pytest.raises(InvalidParamsError, match="page_size"):
        lower(llama_sdpa.fresh(), page_size=0, strict=False)


def test_not_strict_leaves_refused_graph_unchanged_and_logs(caplog):
    cap = capture(tiny_llama("sdpa"), attention_mask=torch.ones(1, 6, dtype=torch.long), **hf_kwargs())
    gm = cap.fresh()
    code, names = gm.code, [n.name for n in gm.graph.nodes]
    with caplog.at_level(logging.WARNING, logger="kvgraph.passes"):
        result = lower(gm, strict=False)
    assert not result.lowered and result.params is None and result.sites == []
    assert "l_kwargs_attention_mask_" in result.reason
    assert gm.code == code and [n.name for n in gm.graph.nodes] == names
    assert "graph left unlowered" in caplog.text
    with pytest.raises(LoweringError, match="l_kwargs_attention_mask_"):
        lower(gm)
    assert gm.code == code


def test_failure_in_a_late_pass_leaves_the_graph_as_captured(llama_sdpa, monkeypatch):
    """A verification failure after DCE (here: a forged layer index) leaves gm untouched."""
    from kvgraph.passes import lower_attention

    real = lower_attention.run

    def forged(gm, sites, kv):
        calls = real(gm, sites, kv)
        calls[1].update_arg(8, 0)
        return calls

    monkeypatch.setattr(lower_attention, "run", forged)
    gm = llama_sdpa.fresh()
    graph, code = gm.graph, gm.code
    result = LoweringPipeline(strict=False)(gm)
    assert not result.lowered and "layer_idx" in result.reason
    assert gm.graph is graph and gm.code == code


def test_captured_graph_object_is_never_edited(llama_sdpa):
    """Dynamo keeps reading the Graph it handed to the backend: lowering swaps in a new one."""
    gm = llama_sdpa.fresh()
    graph = gm.graph
    code = graph.python_code("self").src
    result = lower(gm)
    assert result.gm is gm and gm.graph is not graph
    assert graph.python_code("self").src == code
    assert len(lowered_ops(gm)) == 2


def test_lowered_graph_compiles_inside_a_dynamo_backend():
    """The lowered graph goes through aot_autograd in the backend call that captured it, and runs
    a ragged prefill then a decode step with another token count without recompiling."""
    from torch._dynamo.backends.debugging import aot_eager

    model = TinyDecoder(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))
    state = {"compiles": 0}

    def backend(gm, example_inputs):
        result = lower(gm)
        cache = state["cache"] = RaggedCache(result.params, batch=2)
        names = result.kv_placeholders
        kv = cache.step_inputs(state["new"])
        compiled = aot_eager(gm, [*example_inputs, *(kv[n] for n in names)])
        state["compiles"] += 1

        def run(*args):
            kv = cache.step_inputs(state["new"])
            return compiled(*args, *(kv[n] for n in names))
        return run

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    seqs = [[1, 2, 3, 4], [5, 6]]
    for step, positions in [(seqs, [0, 1, 2, 3, 0, 1]), ([[7], [8]], [4, 2])]:
        state["new"] = [len(s) for s in step]
        if step is not seqs:
            for s, new in zip(seqs, step, strict=True):
                s.extend(new)
        tokens = torch.tensor([t for s in step for t in s])[None]
        with torch.no_grad():
            logits = compiled(input_ids=tokens, position_ids=torch.tensor(positions)[None])
        state["cache"].lengths = [len(s) for s in seqs]
        for b, s in enumerate(seqs):
            torch.testing.assert_close(logits[0, b], eager_last_logits(model, s), atol=1e-5, rtol=0)
    assert state["compiles"] == 1


def test_no_attention_is_refused():
    cap = capture(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), input=torch.randn(1, 3, 4))
    with pytest.raises(LoweringError, match="no attention site"):
        lower(cap.fresh())
