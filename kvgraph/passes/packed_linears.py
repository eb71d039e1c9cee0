"""Pass: every float32 linear layer of a CPU graph as ``kvgraph::linear`` (a weight packed once).

``linear(x, W[, b])`` becomes ``kvgraph::linear(x, W, b)``, the same product
(:mod:`kvgraph.ops.linear`), when ``W`` is module state (a parameter, buffer or frozen
constant: packed once, not per call), a plain float32 tensor (not a subclass such as a
quantized weight, which keeps its own kernel) on the CPU, and ``x`` has the same dtype. The token
count is dynamic, where Inductor would run these layers on oneDNN; MKL's packed product is
1.3-1.6x faster at a decode step's row counts. Runs after ``prune_logits``, which finds the
vocabulary projection as a plain linear.
"""

from __future__ import annotations

import time

import torch
import torch.fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from kvgraph.passes import patterns as P
from kvgraph.passes.graph_view import meta_value, placeholder_kind
from kvgraph.passes.log import log_pass

Node = torch.fx.Node


def run(gm: torch.fx.GraphModule, enabled: bool = True) -> int:
    """Rewrite the packable linear layers of ``gm`` in place; returns how many."""
    start = time.perf_counter()
    if not enabled:
        log_pass("packed_linears", start, "disabled")
        return 0
    done = 0
    for node in gm.graph.nodes:
        if P.is_call(node, P.LINEAR) and node.op == "call_function" and packable(node):
            to_packed_linear(node)
            done += 1
    log_pass("packed_linears", start, f"{done} linear layers packed")
    return done


def _operands(linear: Node) -> tuple[object, object, object]:
    """``(x, weight, bias)`` of ``linear(x, W[, b])`` called by position or keyword."""
    names = ("input", "weight", "bias")
    values = [*linear.args, *(linear.kwargs.get(n) for n in names[len(linear.args):])]
    values += [None] * (3 - len(values))
    return values[0], values[1], values[2]


def packable(linear: Node) -> bool:
    """Whether ``linear``'s weight is float32 module state on the CPU, read by a float32 input."""
    x, weight, _ = _operands(linear)
    if not (isinstance(x, Node) and isinstance(weight, Node)):
        return False
    if weight.op not in ("get_attr", "placeholder") or placeholder_kind(weight) != "constant":
        return False
    x_val, w_val = meta_value(x), meta_value(weight)
    if not (isinstance(x_val, torch.Tensor) and isinstance(w_val, torch.Tensor)):
        return False
    if is_traceable_wrapper_subclass(w_val) or w_val.dim() != 2:
        return False
    return w_val.dtype == x_val.dtype == torch.float32 and w_val.device.type == "cpu"


def to_packed_linear(linear: Node) -> None:
    """``linear(x, W[, b])`` -> ``kvgraph::linear(x, W, b)`` (the same product, packed on the CPU)."""
    import kvgraph.ops.linear  # noqa: F401  (registers torch.ops.kvgraph.linear)

    x, weight, bias = _operands(linear)
    linear.target = torch.ops.kvgraph.linear.default
    linear.args, linear.kwargs = (x, weight, bias), {}
