"""Pass 2: add the KV-cache inputs to the graph as typed placeholders.

After every existing placeholder, in this order: ``kv_blocks``, ``cache_lengths``,
``lookup_table``, ``max_lengths``, for a quantized cache ``kv_scales`` (one per symbol of
``ragged_input_symbols(params)``, i.e. ``manager.input_symbols()[0]``) and ``input_row_offsets``
(int32 ``[batch_size + 1]``).
Each gets ``meta["val"]`` (and Dynamo's ``meta["example_value"]``): a fake tensor of the
graph's own fake mode whose symbolic dims (``total_num_pages``, ``batch_size``, ...) are new
SymInts of the graph's ShapeEnv, ``batch_size`` shared by all of them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from kvgraph.cache.params import KVCacheParams
from kvgraph.cache.symbols import (
    INDEX_DTYPE,
    RaggedKVCacheInputSymbols,
    fake_inputs,
    kv_placeholders,
    ragged_input_symbols,
)
from kvgraph.errors import LoweringError
from kvgraph.passes.graph_view import meta_value
from kvgraph.passes.log import log_pass

Node = torch.fx.Node


@dataclass
class KVPlaceholders:
    """The added placeholder nodes and the symbols that typed them."""

    kv_blocks: Node
    cache_lengths: Node
    lookup_table: Node
    max_lengths: Node
    input_row_offsets: Node
    symbols: RaggedKVCacheInputSymbols
    kv_scales: Node | None = None
    """A quantized cache's scales; ``None`` unquantized."""

    def nodes(self) -> list[Node]:
        """In placeholder order (``kv_placeholders(symbols)``)."""
        return [getattr(self, name) for name in kv_placeholders(self.symbols)]

    def names(self) -> list[str]:
        return [n.name for n in self.nodes()]

    def op_args(self) -> tuple[Node, ...]:
        """In the order of ``kvgraph::ragged_attention``'s cache arguments."""
        return (self.kv_blocks, self.cache_lengths, self.lookup_table, self.input_row_offsets, self.max_lengths)

    def scale_args(self) -> tuple[Node, ...]:
        """The op's arguments after ``softcap``: ``(kv_scales,)`` for a quantized cache, else none."""
        return () if self.kv_scales is None else (self.kv_scales,)


def graph_fake_mode(gm: torch.fx.GraphModule) -> FakeTensorMode:
    """The fake mode (with its ShapeEnv) of ``gm``'s placeholder metadata.

    Read from the fake tensors themselves rather than ``detect_fake_mode``, which inside a
    Dynamo backend call returns the backend's fresh fake mode (same ShapeEnv, other tensors).
    """
    for node in gm.graph.find_nodes(op="placeholder"):
        val = meta_value(node)
        if isinstance(val, FakeTensor) and val.fake_mode.shape_env is not None:
            return val.fake_mode
    raise LoweringError(
        "the graph's placeholders carry no fake tensors with a ShapeEnv (meta['val'] / "
        "meta['example_value']); capture it with torch.compile (Dynamo)"
    )


@contextlib.contextmanager
def uncached(fake_mode: FakeTensorMode) -> Iterator[FakeTensorMode]:
    """Enter ``fake_mode`` with its dispatch cache off: for a few ops on symbolic shapes,
    rebuilding outputs from cache entries costs more than computing them."""
    enabled = fake_mode.cache_enabled
    fake_mode.cache_enabled = False
    try:
        with fake_mode:
            yield fake_mode
    finally:
        fake_mode.cache_enabled = enabled


def run(gm: torch.fx.GraphModule, params: KVCacheParams) -> KVPlaceholders:
    """Add the KV placeholders typed by ``params``; raises ``LoweringError`` if a name is taken."""
    start = time.perf_counter()
    graph = gm.graph
    symbols = ragged_input_symbols(params)
    names = kv_placeholders(symbols)
    taken = sorted({n.name for n in graph.nodes} & set(names))
    if taken:
        raise LoweringError(f"the graph already has nodes named {taken}; cannot add the KV placeholders")
    fake_mode = graph_fake_mode(gm)
    syms: dict[str, torch.SymInt] = {}
    fakes = fake_inputs(list(symbols), fake_mode, syms)
    with uncached(fake_mode):
        offsets = torch.empty((syms["batch_size"] + 1,), dtype=INDEX_DTYPE, device=params.device)
    fakes.append(offsets)
    nodes = []
    anchor = list(graph.find_nodes(op="placeholder"))[-1]
    for name, fake in zip(names, fakes, strict=True):
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(name, type_expr=torch.Tensor)
        anchor.meta["val"] = fake
        anchor.meta["example_value"] = fake
        anchor._dynamo_source = None  # aot_autograd expects one on every placeholder of a Dynamo graph
        nodes.append(anchor)
    kv = KVPlaceholders(**dict(zip(names, nodes, strict=True)), symbols=symbols)
    log_pass("add_kv_inputs", start, ", ".join(f"{n.name}: {_type(meta_value(n))}" for n in nodes))
    return kv


def _type(fake: torch.Tensor) -> str:
    return f"{str(fake.dtype).removeprefix('torch.')}[{', '.join(str(d) for d in fake.shape)}]"
