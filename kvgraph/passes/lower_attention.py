"""Pass 3: replace every attention site with ``kvgraph::ragged_attention`` on the un-repeated K/V.

For site ``i`` (execution order) with ``q [1, Hq, T, D]`` and un-repeated ``k, v [1, Hkv, T, D]``::

    q = q * s ...                        # run-time scale factors folded into q
    out = ragged_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                           kv_blocks, cache_lengths, lookup_table, input_row_offsets,
                           max_lengths, layer_idx=i, scale=scale,
                           sliding_window=w, softcap=c,  # [T, Hq, D]; w from the proven mask,
                           kv_scales)                    # c from a tanh soft-cap; or None;
                                                         # kv_scales only for a quantized cache
    site -> out.transpose(0, 1)[None]    # [1, Hq, T, D]

The old site (and its mask subgraph) is left without users for dead-code elimination.
New nodes get Dynamo's ``meta["example_value"]`` computed in the graph's fake mode.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kvgraph.errors import LoweringError
from kvgraph.passes.add_kv_inputs import KVPlaceholders, graph_fake_mode, uncached
from kvgraph.passes.find_attention import AttentionSite
from kvgraph.passes.graph_view import meta_value
from kvgraph.passes.log import log_pass
from kvgraph.passes.patterns import KVRepeat

Node = torch.fx.Node
_FACTOR_OPS = {"mul": operator.mul, "div": operator.truediv}
_PROVENANCE = ("stack_trace", "nn_module_stack", "source_fn_stack")


def ragged_attention_op() -> torch._ops.OpOverload:
    """``torch.ops.kvgraph.ragged_attention.default`` (importing ``kvgraph.ops`` registers it)."""
    try:
        import kvgraph.ops  # noqa: F401

        return torch.ops.kvgraph.ragged_attention.default
    except (ImportError, AttributeError) as exc:
        raise LoweringError(f"the kvgraph::ragged_attention op is not available: {exc}") from exc


def run(gm: torch.fx.GraphModule, sites: list[AttentionSite], kv: KVPlaceholders) -> list[Node]:
    """Lower ``sites`` (layer_idx order) onto ``kv``'s placeholders; returns the new op nodes."""
    start = time.perf_counter()
    op = ragged_attention_op()
    fake_mode = graph_fake_mode(gm)
    calls = []
    for site in sites:
        emit = _Emitter(gm.graph, fake_mode, site.node)
        with gm.graph.inserting_before(site.node):
            q = site.q
            for name, factor in site.scale_factors:
                q = emit(_FACTOR_OPS[name], q, factor)
            q3, k3, v3 = (emit(torch.transpose, emit(torch.squeeze, x, 0), 0, 1) for x in (q, site.k, site.v))
            call = emit(op, q3, k3, v3, *kv.op_args(), site.layer_idx, site.scale, site.sliding_window,
                        site.softcap, *kv.scale_args())
            out = emit(torch.unsqueeze, emit(torch.transpose, call, 0, 1), 0)
            dtype = meta_value(site.node).dtype
            if meta_value(out).dtype != dtype:
                out = emit(torch.Tensor.to, out, dtype)
        site.node.replace_all_uses_with(out)
        calls.append(call)
    log_pass("lower_attention", start,
             f"{len(calls)} sites -> {op}, layer_idx 0..{len(calls) - 1}, "
             f"{sum(1 for s in sites if s.repeat in (KVRepeat.EXPAND_RESHAPE, KVRepeat.REPEAT_INTERLEAVE))} un-repeated K/V")
    return calls


class _Emitter:
    """Creates call_function nodes with fake ``example_value`` and the site's provenance."""

    def __init__(self, graph: torch.fx.Graph, fake_mode: FakeTensorMode, origin: Node) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.provenance = {k: origin.meta[k] for k in _PROVENANCE if k in origin.meta}

    def __call__(self, target: Callable, *args: object) -> Node:
        node = self.graph.call_function(target, args)
        fake_args = torch.fx.node.map_arg(args, meta_value)
        with uncached(self.fake_mode):
            node.meta["example_value"] = target(*fake_args)
        node.meta.update(self.provenance)
        return node
