"""The lowered graph's attention calls straight to the C++ CPU kernel, when that is the kernel.

``kvgraph::ragged_attention`` on CPU tensors runs in Python before the kernel: it checks the
step's plan and each layer's q/k/v, then calls ``kvgraph_cpu::ragged_attention``, which has the
same schema. In a graph kvgraph compiled, those checks hold by construction: the fake
implementation checked q/k/v when the graph was traced, and the runtime checks the bound cache
against the graph's params at each call (:func:`kvgraph.compiler.runtime.check_fit`). So
where the C++ kernel is the CPU implementation, the graph calls it directly: no Python between
the compiled graph and the kernel (about 0.4 ms of a 5 ms batch-1 decode step on ``llama-56m``,
8 layers, under the profiler). The kernel still checks the index values; its ``ValueError``
reaches the caller as :class:`~kvgraph.errors.CacheInputError` (:func:`typed_kernel_errors`).

Likewise ``kvgraph::linear``, whose float32 CPU path is MKL's packed GEMM with the weight packed
once (:mod:`kvgraph.ops.linear`): the graph calls ``kvgraph_cpu::packed_linear``, the same path
with the pack kept in C++ (``csrc/packed_linear_cpu.cpp``), instead of the op's Python
implementation (about 7 us a call, 57 calls a step of ``llama-56m``).

The backend redirects a copy of the lowered graph, the one it compiles: the lowered graph itself
(what ``kvgraph dump`` shows) and direct calls of the ops keep ``kvgraph::ragged_attention`` and
``kvgraph::linear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx

from kvgraph.errors import CacheInputError


def redirectable_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``gm``'s calls that a C++ kernel of this process serves (building kvgraph's library on first
    use): ``kvgraph::ragged_attention`` where the C++ kernel is the CPU implementation, and
    ``kvgraph::linear`` where the packed C++ path runs; else none."""
    from kvgraph.ops import attention, cpp, linear  # noqa: F401  (linear defines kvgraph::linear)

    calls = []
    if attention.cpu_implementation() == "cpp":
        calls += gm.graph.find_nodes(op="call_function", target=torch.ops.kvgraph.ragged_attention.default)
    linears = gm.graph.find_nodes(op="call_function", target=torch.ops.kvgraph.linear.default)
    if linears and cpp.packed_linear_kernel() is not None:
        calls += linears
    return calls


def call_cpu_kernel_directly(gm: torch.fx.GraphModule) -> int:
    """Point every call of :func:`redirectable_calls` in ``gm`` at its C++ kernel, in place
    (``kvgraph_cpu::ragged_attention``, ``kvgraph_cpu::packed_linear``); returns how many calls moved."""
    from kvgraph.ops import cpp
    from kvgraph.ops.linear import PACK_ROWS, max_packed_rows

    calls = redirectable_calls(gm)
    for node in calls:
        if node.target is torch.ops.kvgraph.linear.default:
            x, weight, *rest = node.args
            bias = rest[0] if rest else node.kwargs.get("bias")
            node.target = cpp.packed_linear_kernel()
            node.args, node.kwargs = (x, weight, bias, max_packed_rows(), PACK_ROWS), {}
        else:
            node.target = cpp.direct_kernel()
    if calls:
        gm.recompile()
    return len(calls)


@contextlib.contextmanager
def typed_kernel_errors() -> Iterator[None]:
    """Re-raise the C++ kernel's ``ValueError`` (an index value out of range) as ``CacheInputError``,
    as the op itself does."""
    try:
        yield
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        raise CacheInputError(str(e)) from None
