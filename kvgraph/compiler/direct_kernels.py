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

The backend redirects a copy of the lowered graph, the one it compiles: the lowered graph itself
(what ``kvgraph dump`` shows) and direct calls of the op keep ``kvgraph::ragged_attention``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx

from kvgraph.errors import CacheInputError


def redirectable_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``gm``'s ``kvgraph::ragged_attention`` calls, if the C++ kernel serves the op on the CPU in
    this process (building it on first use); else none."""
    from kvgraph.ops import attention

    if attention.cpu_implementation() != "cpp":
        return []
    return list(gm.graph.find_nodes(op="call_function", target=torch.ops.kvgraph.ragged_attention.default))


def call_cpu_kernel_directly(gm: torch.fx.GraphModule) -> int:
    """Point every call of :func:`redirectable_calls` in ``gm`` at ``kvgraph_cpu::ragged_attention``,
    in place; returns how many calls moved."""
    from kvgraph.ops import cpp

    calls = redirectable_calls(gm)
    if calls:
        kernel = cpp.direct_kernel()
        for node in calls:
            node.target = kernel
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
