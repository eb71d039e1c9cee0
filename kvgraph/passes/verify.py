"""Pass 5: dead-code elimination, then verification of the lowered graph.

``dce`` drops what lowering left without users: the old attention calls, repeated K/V and
the mask-building subgraph. ``run`` checks that

* the graph lints;
* no attention is left un-lowered (no SDPA / flash / flex call, no softmax over ``[..., T, T]``);
* there is one ``kvgraph::ragged_attention`` per site, with ``layer_idx`` exactly ``0..N-1``,
  each reading the KV placeholders;
* every KV placeholder is used;
* the mask-only nodes found by ``find_attention`` are gone.

A failure raises ``LoweringError`` listing every problem.
"""

from __future__ import annotations

import operator
import time

import torch
import torch.fx

from kvgraph.errors import LoweringError
from kvgraph.passes import patterns as P
from kvgraph.passes.add_kv_inputs import KVPlaceholders
from kvgraph.passes.find_attention import AttentionAnalysis
from kvgraph.passes.graph_view import describe
from kvgraph.passes.log import log_pass
from kvgraph.passes.lower_attention import ragged_attention_op

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift,
})


def has_side_effects(node: torch.fx.Node) -> bool:
    """What DCE must keep: torch.fx's impure nodes, and in-place tensor ops (``x.add_(y)``,
    ``x += y``), whose unused results do not make them dead in a Dynamo graph."""
    if node.is_impure():
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    if node.target in _INPLACE_OPERATORS:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = getattr(node.target, "__name__", "")  # torch.relu_, torch.Tensor.add_ (not operator.and_)
    return name.endswith("_") and not name.startswith("_") and getattr(node.target, "__module__", "") != "_operator"


def dce(gm: torch.fx.GraphModule) -> int:
    """Remove nodes without users (placeholders and side effects stay); returns how many."""
    start = time.perf_counter()
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)
    removed = before - len(gm.graph.nodes)
    log_pass("dce", start, f"removed {removed} nodes, {len(gm.graph.nodes)} left")
    return removed


def run(gm: torch.fx.GraphModule, analysis: AttentionAnalysis, kv: KVPlaceholders) -> None:
    """Raise ``LoweringError`` listing every way the lowered graph is wrong."""
    start = time.perf_counter()
    problems: list[str] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises plain RuntimeErrors of several kinds
        problems.append(f"graph lint: {exc}")
    op = ragged_attention_op()
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is op:
            calls.append(node)
        elif P.is_sdpa(node) or P.is_attention_target(node):
            problems.append(f"un-lowered attention {describe(node)}")
        elif P.is_last_dim_softmax(node) and P.is_token_square(node.args[0]):
            problems.append(f"un-lowered softmax over tokens {describe(node)}")
    layers = [n.args[8] for n in calls]
    if sorted(layers) != list(range(analysis.num_layers)):
        problems.append(f"layer_idx of the {len(calls)} ragged_attention calls are {layers}, "
                        f"expected 0..{analysis.num_layers - 1} once each")
    for call in calls:
        if tuple(call.args[3:8]) != kv.op_args() or tuple(call.args[12:]) != kv.scale_args():
            problems.append(f"{call.name} does not read the KV placeholders {kv.names()}")
    problems += [f"KV placeholder '{n.name}' is unused" for n in kv.nodes() if not n.users]
    alive = set(gm.graph.nodes)
    left = sorted(n.name for n in analysis.mask_nodes if n in alive)
    if left:
        problems.append(f"mask-building nodes survived lowering: {left}")
    if problems:
        raise LoweringError("the lowered graph failed verification:\n  " + "\n  ".join(problems))
    log_pass("verify", start, f"{len(calls)} ragged_attention calls, layer_idx 0..{len(calls) - 1}, "
             f"{len(analysis.mask_nodes)} mask nodes gone, all {len(kv.nodes())} KV inputs used")
