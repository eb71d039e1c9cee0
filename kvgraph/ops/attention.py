"""The fused KV-cache attention op ``kvgraph::ragged_attention``: its definition and its one dispatch.

``torch.ops.kvgraph.ragged_attention(q, k, v, kv_blocks, cache_lengths, lookup_table,
input_row_offsets, max_lengths, layer_idx, scale=None, sliding_window=None, softcap=None, kv_scales=None)``
first stores the new tokens' K and V (quantized with their ``kv_scales`` for a quantized cache) into
layer ``layer_idx`` of the cache, then returns causal attention of
every new token over its own sequence (cached prefix + new tokens up to itself). Token ``i``
of sequence ``b`` sits at position ``p = cache_lengths[b] + i - input_row_offsets[b]`` and sees
positions ``0..p``, or with a ``sliding_window`` of ``w`` tokens only ``max(0, p - w + 1)..p``
(Mistral's and Gemma's local attention: ``w`` keys, itself included). With ``softcap`` ``c``
each score ``s = scale * q.k`` becomes ``c * tanh(s / c)`` before softmax (Gemma 2's logit
soft-capping). The arguments, their shapes and the schema are :mod:`kvgraph.ops.schema`'s.

Implementations: a fake (shape) impl for tracing; CPU and CUDA tensors go through
:func:`dispatch`, which checks the arguments against the step's plan (:mod:`kvgraph.ops.plan`) and
runs, on the CPU, the C++ paged kernel (:mod:`kvgraph.ops.cpp`, pages read in place), the SDPA
path (:mod:`kvgraph.ops.cpu`) or the reference (:mod:`kvgraph.ops.reference`) as
``KVGRAPH_CPU_ATTENTION`` chooses; on CUDA, the Triton kernels (:mod:`kvgraph.ops.triton`,
imported when first called).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops.checks import attention_fake
from kvgraph.ops.plan import StepPlan, plan_for
from kvgraph.ops.schema import SCHEMA, AttentionArgs

Run = Callable[[AttentionArgs, StepPlan], torch.Tensor]

_LIB = torch.library.Library("kvgraph", "DEF")
_LIB.define("ragged_attention" + SCHEMA)
ragged_attention = torch.ops.kvgraph.ragged_attention
_cpu_run: Run | None = None  # the CPU implementation, chosen on first use (see kvgraph.ops.cpp)


def cpu_implementation() -> str:
    """``"cpp"``, ``"sdpa"`` or ``"reference"``: what serves the op on CPU tensors in this process (chosen on first use)."""
    from kvgraph.ops import cpp, cpu, reference

    global _cpu_run
    if _cpu_run is None:
        _cpu_run = reference.run if cpp.choice() == "reference" else cpp.run if cpp.available() else cpu.run
    return {cpp.run: "cpp", cpu.run: "sdpa", reference.run: "reference"}[_cpu_run]


def implementation(device: torch.device) -> Run:
    """The ``run(args, plan)`` serving tensors on ``device``: Triton on CUDA, the chosen CPU one elsewhere."""
    if device.type == "cuda":
        from kvgraph.ops.triton.api import run

        return run
    if _cpu_run is None:
        cpu_implementation()
    return _cpu_run


QUANTIZED_DEVICE_TYPES = ("cpu", "cuda")
"""Device types with an implementation that reads a quantized cache: the CPU ones (C++, SDPA path and
reference) and the Triton kernels all dequantize in their reads."""


def check_quantized_device(device: torch.device) -> None:
    """``CacheInputError`` unless a quantized cache on ``device`` has an implementation that reads it."""
    if device.type not in QUANTIZED_DEVICE_TYPES:
        raise CacheInputError(
            f"a quantized KV cache on {device} has no attention kernel: only {list(QUANTIZED_DEVICE_TYPES)} "
            f"devices read one"
        )


def dispatch(args: AttentionArgs) -> torch.Tensor:
    """Check ``args`` (the step's plan, reused within a bound step, and this layer), then run the op."""
    plan = plan_for(args)
    if args.kv_scales is not None:
        check_quantized_device(plan.device)
    return implementation(plan.device)(args, plan)


@torch.library.impl(_LIB, "ragged_attention", "CPU")
@torch.library.impl(_LIB, "ragged_attention", "CUDA")
def _ragged_attention(*args: object, **kwargs: object) -> torch.Tensor:
    """CPU and CUDA: :func:`dispatch` (arguments as :class:`~kvgraph.ops.schema.AttentionArgs`)."""
    return dispatch(AttentionArgs(*args, **kwargs))


torch.library.register_fake("kvgraph::ragged_attention", attention_fake, lib=_LIB)
