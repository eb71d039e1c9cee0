"""Pass 4: compute the vocabulary projection only at the token positions whose logits are wanted.

The graph's logits ``[1, T, V]`` come from a final ``linear(x [1, T, C], W)`` (then maybe
casts, scalar scaling, ``tanh`` soft-capping). With a ragged batch only each sequence's
last new token is sampled, so the pass adds one more graph input, ``logit_positions``
(``int32 [num_logits]``: indices into the step's ``T`` flattened tokens), after the KV
placeholders; the linear gets ``x.index_select(1, logit_positions)`` ``[1, num_logits, C]`` and
the logits become ``[1, num_logits, V]``: prefill no longer projects every prompt token onto the
vocabulary. The runtime binds ``input_row_offsets[1:] - 1`` (each sequence's last new token,
``num_logits = batch``) unless the step asks for more rows, e.g. every prompt position of a
request that wants its prompt's log-probabilities: one graph serves both, with no recompile
(``num_logits`` is a symbolic size of its own).

A graph that already keeps only the last token (``x[:, -1:]``, ``x[:, [-1]]``, as nanoGPT
and ``logits_to_keep=1`` do, or ``x[:, -1]``) would return one row for the whole flattened
batch; that slice is replaced the same way (``x[:, -1]`` then gives ``[batch, V]``), and
refused if pruning is disabled.

The projection stays a plain linear; on the CPU ``packed_linears`` (the next pass) packs it
with the model's other linear layers.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.node import map_arg

from kvgraph.cache.symbols import INDEX_DTYPE, LOGIT_POSITIONS, make_symints
from kvgraph.errors import LoweringError
from kvgraph.ops import int8_linear  # noqa: F401  (defines kvgraph::int8_weight_linear)
from kvgraph.passes import patterns as P
from kvgraph.passes.add_kv_inputs import graph_fake_mode, uncached
from kvgraph.passes.graph_view import describe, meta_value
from kvgraph.passes.log import log_pass

Node = torch.fx.Node
_TANH = (frozenset({torch.tanh}), frozenset({"tanh"}))
# a vocabulary projection: a linear layer, or an int8 weight-only one (kvgraph.engine.quantization),
# as kvgraph's op or, where kvgraph's C++ library is built, its CPU routing (named: that op is
# defined only once the library is)
_PROJECTION = (P.LINEAR[0] | {torch.ops.kvgraph.int8_weight_linear, torch.ops.kvgraph.int8_weight_linear.default},
               frozenset())
_CPP_PROJECTION = "kvgraph_cpu::int8_weight_linear"


@dataclass
class LogitsSite:
    """A graph output computed by a final linear layer from per-token hidden states."""

    linear: Node  # linear(x, W[, b]) -> [1, T or 1, V]
    hidden: Node  # x0: the per-token hidden states [1, T, C]
    last_token_slice: Node | None  # x = x0[:, -1:] (or x0[:, -1]) when the graph keeps only the last token
    chain: list[Node]  # nodes from the linear to the output, in order
    drops_token_dim: bool = False  # x0[:, -1]: the logits are [1, V], pruned to [batch, V]


def find_logits(gm: torch.fx.GraphModule, token_count: int | torch.SymInt) -> list[LogitsSite]:
    """Outputs that are a final linear layer over ``[1, T, C]`` hidden states (or their last token)."""
    output = gm.graph.output_node()
    found = []
    for out in output.all_input_nodes:
        chain = _chain_to_linear(out, output)
        if chain is None:
            continue
        linear = chain[0]
        x = linear.args[0]
        kind = _last_token_slice(x, token_count)
        hidden = x.args[0] if kind is not None else x
        s = P.shape(hidden)
        if s and len(s) == 3 and s[0] == 1 and P.same_size(s[1], token_count):
            found.append(LogitsSite(linear, hidden, x if kind else None, chain, kind == "drop"))
    return found


def run(
    gm: torch.fx.GraphModule,
    after: Node,
    token_count: int | torch.SymInt,
    enabled: bool = True,
) -> bool:
    """Prune the logits to the rows of a new ``logit_positions`` input (placed after the
    placeholder ``after``); returns whether any output was pruned (and the input added).

    With ``enabled=False`` nothing changes, but a graph that keeps only the last token of the
    flattened batch raises ``LoweringError`` (its output would be wrong for a ragged batch).
    """
    start = time.perf_counter()
    sites = find_logits(gm, token_count)
    if not enabled:
        for site in sites:
            if site.last_token_slice is not None:
                raise LoweringError(
                    f"the graph keeps only the last token's logits ({describe(site.last_token_slice)}), "
                    "which is one row for a whole ragged batch; lower with prune_logits=True"
                )
        log_pass("prune_logits", start, "disabled")
        return False
    fake_mode = graph_fake_mode(gm)
    graph = gm.graph
    positions = _add_positions(gm, after, fake_mode) if sites else None
    for site in sites:
        with graph.inserting_before(site.linear):
            rows = graph.call_function(torch.index_select, (site.hidden, 1, positions))  # [1, num_logits, C]
            new = [rows]
            if site.drops_token_dim:
                new.append(graph.call_function(operator.getitem, (rows, 0)))  # [num_logits, C]
        site.linear.replace_input_with(site.linear.args[0], new[-1])
        for node in (*new, *site.chain):
            _refresh(node, fake_mode)
    names = ", ".join(f"{s.linear.name} {tuple(meta_value(s.chain[-1]).shape)}" for s in sites)
    log_pass("prune_logits", start, f"pruned {names}" if sites else "no final linear on the outputs")
    return bool(sites)


def _add_positions(gm: torch.fx.GraphModule, after: Node, fake_mode) -> Node:
    """The ``logit_positions`` placeholder, ``int32 [num_logits]`` with a new symbolic size, after ``after``."""
    if any(n.name == LOGIT_POSITIONS for n in gm.graph.nodes):
        raise LoweringError(f"the graph already has a node named {LOGIT_POSITIONS!r}; cannot add the input")
    (num_logits,) = make_symints(["num_logits"], fake_mode.shape_env).values()
    device = meta_value(after).device
    with uncached(fake_mode):
        fake = torch.empty((num_logits,), dtype=INDEX_DTYPE, device=device)
    with gm.graph.inserting_after(after):
        node = gm.graph.placeholder(LOGIT_POSITIONS, type_expr=torch.Tensor)
    node.meta["val"] = node.meta["example_value"] = fake
    node._dynamo_source = None  # aot_autograd expects one on every placeholder of a Dynamo graph
    return node


def _is_projection(node: object) -> bool:
    """Whether ``node`` is a linear layer (:data:`_PROJECTION`, or kvgraph's C++ int8 routing)."""
    if P.is_call(node, _PROJECTION):
        return True
    target = node.target if isinstance(node, Node) and node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name == _CPP_PROJECTION
    return isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name == _CPP_PROJECTION


def _chain_to_linear(out: Node, output: Node) -> list[Node] | None:
    """``[linear, ..., out]`` if ``out`` is a final linear followed only by per-token elementwise ops."""
    chain = [out]
    node = out
    while not _is_projection(node):
        if P.is_call(node, P.CASTS) or P.is_call(node, _TANH):
            node = node.args[0]
        elif (P.is_call(node, P.MUL) or P.is_call(node, P.DIV)) and len(node.args) == 2:
            a, b = node.args
            if P.is_scalar(b):
                node = a
            elif P.is_call(node, P.MUL) and P.is_scalar(a):
                node = b
            else:
                return None
        else:
            return None
        if not isinstance(node, Node):
            return None
        chain.insert(0, node)
    allowed = set(chain) | {output}
    if any(not set(n.users) <= allowed for n in chain):
        return None
    return chain


def _last_token_slice(x: object, token_count: int | torch.SymInt) -> str | None:
    """``"keep"`` for ``x0[:, -1:]`` / ``x0[:, [-1]]``, ``"drop"`` for ``x0[:, -1]`` (trailing full
    slices allowed) of ``x0 [1, T, C]``; else None."""
    if not (isinstance(x, Node) and x.op == "call_function" and x.target is operator.getitem):
        return None
    x0, idx = x.args
    full = slice(None, None, None)
    if not (isinstance(idx, tuple) and len(idx) >= 2 and idx[0] == full):
        return None
    s = P.shape(x0)
    if not (all(i == full or i is Ellipsis for i in idx[2:]) and s and len(s) == 3
            and P.same_size(s[1], token_count)):
        return None
    if idx[1] == slice(-1, None, None) or idx[1] == [-1]:
        return "keep"
    return "drop" if idx[1] == -1 else None


def _refresh(node: Node, fake_mode) -> None:
    """Recompute ``node``'s fake ``example_value`` from its inputs' (after a rewrite upstream)."""
    args = map_arg(node.args, meta_value)
    kwargs = map_arg(node.kwargs, meta_value)
    with uncached(fake_mode):
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value
    if "val" in node.meta:
        node.meta["val"] = value
