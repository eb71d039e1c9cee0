"""GraphView: shape-only edges, dataflow helpers, placeholder kinds, error descriptions, graph copies."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.fx
import torch.nn as nn
from torch._dynamo.source import LocalSource

from kvgraph.passes.graph_view import (
    GraphView,
    _is_varkw,
    copy_graph,
    describe,
    is_shape_read,
    placeholder_kind,
)
from tests.passes.lowering_helpers import capture, model_kwargs


def mask_of(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.size(1)  # a metadata read of x
    i = torch.arange(n)
    mask = i[:, None] >= i[None, :]
    return mask, x * 2 + bias


def traced() -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    gm = torch.fx.symbolic_trace(mask_of)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_size_reads_are_shape_only_edges():
    gm, n = traced()
    view = GraphView(gm)
    assert is_shape_read(n["size"], n["x"])
    assert view.g.edges[n["x"], n["size"]]["shape_only"]
    assert not view.g.edges[n["x"], n["mul"]]["shape_only"]


def test_data_ancestors_stop_at_shape_reads():
    gm, n = traced()
    view = GraphView(gm)
    mask = n["ge"]
    ancestors = view.data_ancestors([mask])
    assert n["size"] in ancestors and n["arange"] in ancestors
    assert n["x"] not in ancestors and n["bias"] not in ancestors
    assert view.shape_sources(ancestors) == {n["x"]}
    assert view.leaves(ancestors) == []


def test_only_feeding_finds_what_dies_with_the_consumers():
    gm, n = traced()
    view = GraphView(gm)
    mask_graph = view.data_ancestors([n["ge"]])
    dead = view.only_feeding(mask_graph - {n["ge"]}, {n["ge"]})
    assert dead == mask_graph - {n["ge"]}
    # x also feeds the second output: it is never "only feeding" the mask
    assert n["x"] not in view.only_feeding({n["x"], n["size"]}, {n["ge"]})


def test_placeholder_kinds_of_a_dynamo_graph(llama_sdpa):
    kinds = {n.name: placeholder_kind(n) for n in llama_sdpa.gm.graph.find_nodes(op="placeholder")}
    assert list(kinds.values()).count("size") == 1  # the token count SymInt
    assert kinds["l_kwargs_input_ids_"] == "input"
    assert kinds["l_kwargs_position_ids_"] == "position"
    # the module is ``self`` or ``args_0`` in Dynamo's names, depending on how the call reached it
    by_suffix = {name.split("_modules_", 1)[-1]: kind for name, kind in kinds.items()}
    assert by_suffix["lm_head_parameters_weight_"] == "constant"
    assert by_suffix["model_modules_layers_modules_0_modules_self_attn_scaling"] == "constant"
    assert by_suffix["model_modules_rotary_emb_buffers_inv_freq_"] == "constant"


def test_placeholder_kinds_come_from_dynamo_sources_not_names():
    """Module state reached through a closure (no ``l_self_`` in its name) is a constant, a closure
    tensor too; an integer argument named like positions is an input; ``position_ids`` is the positions."""
    module = nn.Linear(4, 4)
    module.register_buffer("table", torch.ones(8, 8).tril())
    offset = torch.ones(4)

    def forward(input_ids, position_ids, pos_mask):
        x = module(torch.ones(1, input_ids.shape[1], 4)) + offset
        return x * module.table[position_ids].sum() + pos_mask.sum() + input_ids.sum()

    gm = capture(forward, pos_mask=torch.ones(1, 6, dtype=torch.int64), **model_kwargs()).gm
    kinds = {n.name: placeholder_kind(n) for n in gm.graph.find_nodes(op="placeholder")}
    assert kinds["l_pos_mask_"] == kinds["l_input_ids_"] == "input"
    assert kinds["l_position_ids_"] == "position"
    assert kinds["l_module_buffers_table_"] == kinds["l_module_parameters_weight_"] == kinds["l_offset_"] == "constant"


def test_input_sources_follow_values_not_constants(llama_sdpa):
    gm = llama_sdpa.gm
    view = GraphView(gm)
    ids = next(n for n in gm.graph.nodes if n.name == "l_kwargs_input_ids_")
    logits = gm.graph.output_node().args[0][0]
    assert view.input_sources(logits) == frozenset({ids})
    arange = next(n for n in gm.graph.nodes if n.name == "q_arange")
    assert view.input_sources(arange) == frozenset()


def test_describe_names_node_target_and_source_line(llama_sdpa):
    sdpa = next(n for n in llama_sdpa.gm.graph.nodes if "scaled_dot_product" in str(n.target))
    text = describe(sdpa)
    assert text.startswith(f"node '{sdpa.name}' (call_function torch._C._nn.scaled_dot_product_attention) at ")
    assert "sdpa_attention.py:" in text and "scaled_dot_product_attention(" in text


def test_copy_graph_is_independent():
    gm, n = traced()
    copied = torch.fx.GraphModule(gm, copy_graph(gm.graph))
    assert copied.code == gm.code
    node = next(iter(copied.graph.find_nodes(op="call_function", target=torch.arange)))
    node.meta["tag"] = 1
    with copied.graph.inserting_after(node):
        copied.graph.call_function(torch.neg, (node,))
    copied.recompile()
    assert "tag" not in n["arange"].meta and "neg" not in gm.code


def test_kwargs_is_recognised_with_and_without_dynamos_varkw_flag():
    assert _is_varkw(LocalSource("extra", is_input=True, is_varkw=True))
    assert not _is_varkw(LocalSource("kwargs", is_input=True, is_varkw=False))
    # a torch whose LocalSource has no is_varkw (2.11): the frame's ``**kwargs`` by its name
    assert _is_varkw(SimpleNamespace(local_name="kwargs"))
    assert not _is_varkw(SimpleNamespace(local_name="position_ids"))
