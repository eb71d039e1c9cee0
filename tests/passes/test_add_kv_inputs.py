"""add_kv_inputs: placeholders typed by the manager's symbols, in the graph's own fake mode."""

from __future__ import annotations

import pytest
import torch

from kvgraph.cache.params import KVCacheParams
from kvgraph.cache.quant import KVCacheQuantizationConfig
from kvgraph.cache.symbols import KV_PLACEHOLDERS, ragged_input_symbols
from kvgraph.errors import LoweringError
from kvgraph.passes import add_kv_inputs
from kvgraph.passes.add_kv_inputs import graph_fake_mode
from tests.naming import raises_naming


def params(strategy: str) -> KVCacheParams:
    return KVCacheParams(torch.float16, n_kv_heads=2, head_dim=16, num_layers=2, page_size=8,
                         cache_strategy=strategy)


def shape_exprs(val: torch.Tensor) -> list:
    return [d.node.expr if isinstance(d, torch.SymInt) else d for d in val.shape]


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_placeholders_follow_the_symbols(llama_sdpa, strategy):
    gm = llama_sdpa.fresh()
    kv = add_kv_inputs.run(gm, params(strategy))
    placeholders = gm.graph.find_nodes(op="placeholder")
    assert [n.name for n in placeholders[-5:]] == list(KV_PLACEHOLDERS) == kv.names()
    assert kv.symbols == ragged_input_symbols(params(strategy))
    fake_mode = graph_fake_mode(llama_sdpa.gm)
    for node, symbol in zip(kv.nodes(), kv.symbols, strict=False):
        val = node.meta["val"]
        assert node.meta["example_value"] is val and val.fake_mode is fake_mode
        assert val.dtype == symbol.dtype and val.device == symbol.device
        assert [isinstance(d, torch.SymInt) for d in val.shape] == [isinstance(d, str) for d in symbol.shape]
        assert [d for d in val.shape if isinstance(d, int)] == [d for d in symbol.shape if isinstance(d, int)]
    vals = {n.name: n.meta["val"] for n in kv.nodes()}
    batch = shape_exprs(vals["cache_lengths"])[0]
    assert shape_exprs(vals["lookup_table"])[0] == batch
    assert shape_exprs(vals["input_row_offsets"]) == [batch + 1]
    assert vals["input_row_offsets"].dtype == torch.int32
    if strategy == "continuous":
        assert vals["lookup_table"].dim() == 1 and isinstance(vals["kv_blocks"].shape[3], torch.SymInt)
    else:
        assert vals["lookup_table"].dim() == 2 and vals["kv_blocks"].shape[3] == 8
    assert kv.op_args() == (kv.kv_blocks, kv.cache_lengths, kv.lookup_table, kv.input_row_offsets, kv.max_lengths)


@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_a_quantized_cache_adds_its_scales_after_max_lengths(llama_sdpa, strategy):
    quantized = KVCacheParams(torch.int8, n_kv_heads=2, head_dim=16, num_layers=2, page_size=8,
                              cache_strategy=strategy,
                              kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=8))
    gm = llama_sdpa.fresh()
    kv = add_kv_inputs.run(gm, quantized)
    names = ["kv_blocks", "cache_lengths", "lookup_table", "max_lengths", "kv_scales", "input_row_offsets"]
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")[-6:]] == names == kv.names()
    blocks, scales = kv.kv_blocks.meta["val"], kv.kv_scales.meta["val"]
    assert blocks.dtype == torch.int8 and scales.dtype == torch.float32
    assert shape_exprs(scales)[:5] == shape_exprs(blocks)[:5] and scales.shape[5] == 2
    assert kv.scale_args() == (kv.kv_scales,)


def test_taken_name_is_refused(llama_sdpa):
    gm = llama_sdpa.fresh()
    add_kv_inputs.run(gm, params("paged"))
    with raises_naming(LoweringError, "nodes named", "['cache_lengths', 'input_row_offsets'"):

        add_kv_inputs.run(gm, params("paged"))


def test_graph_without_fake_metadata_is_refused():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(LoweringError, match="no fake tensors"):
        add_kv_inputs.run(gm, params("paged"))
