"""The fused KV-cache attention op ``kvgraph::ragged_attention``: its definition and dispatch.

``torch.ops.kvgraph.ragged_attention(q, k, v, kv_blocks, cache_lengths, lookup_table,
input_row_offsets, max_lengths, layer_idx, scale=None, sliding_window=None, softcap=None)`` first stores
the new tokens' K and V into layer ``layer_idx`` of the cache, then returns causal attention of
every new token over its own sequence (cached prefix + new tokens up to itself). Token ``i``
of sequence ``b`` sits at position ``p = cache_lengths[b] + i - input_row_offsets[b]`` and sees
positions ``0..p``, or with a ``sliding_window`` of ``w`` tokens only ``max(0, p - w + 1)..p``
(Mistral's and Gemma's local attention: ``w`` keys, itself included). With ``softcap`` ``c``
each score ``s = scale * q.k`` becomes ``c * tanh(s / c)`` before softmax (Gemma 2's logit
soft-capping).

Implementations: a fake (shape) impl for tracing; on the CPU the C++ paged kernel
(:mod:`kvgraph.ops.cpp`, pages read in place), or the SDPA path (:mod:`kvgraph.ops.cpu`)
where no compiler is at hand or ``KVGRAPH_CPU_ATTENTION=sdpa``; on CUDA, the Triton kernels
(``kvgraph.ops.triton.ragged_attention``, imported when first called). Every implementation
checks its arguments with :mod:`kvgraph.ops.checks`.
"""

from __future__ import annotations

import torch

from kvgraph.ops.checks import check_inputs

SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, Tensor max_lengths, int layer_idx, float? scale=None, "
    "int? sliding_window=None, float? softcap=None) -> Tensor"
)


_LIB = torch.library.Library("kvgraph", "DEF")
_LIB.define("ragged_attention" + SCHEMA)
_cpu_kernel = None  # the CPU implementation, chosen on first use (see kvgraph.ops.cpp)


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    layer_idx: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store the new K/V into the cache, then causal attention over each sequence's cache.

    Args:
        q: ``[T, Hq, D]`` new tokens of all sequences, flattened (ragged).
        k, v: ``[T, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        kv_blocks: written in place. Paged ``[total_num_pages, 2, num_layers, page_size, Hkv, D]``;
            continuous ``[max_batch_size, 2, num_layers, max_seq_len, Hkv, D]``; axis 1: 0 = K, 1 = V.
        cache_lengths: ``int32 [batch]`` tokens cached before this step.
        lookup_table: ``int32``; paged ``[batch, max_num_pages]`` (unused = ``total_num_pages``),
            continuous ``[batch]`` (slot of each sequence).
        input_row_offsets: ``int32 [batch + 1]`` prefix sums of new tokens per sequence.
        max_lengths: ``int32 [num_steps, 2]`` on the CPU; row 0 = ``[max new, max cached + new]``.
        layer_idx: the layer of the cache to write and read.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        sliding_window: ``w`` >= 1: the token at position ``p`` sees only positions ``p - w + 1..p``
            (the cache still holds every position); ``None``: all of ``0..p``.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before softmax; ``None``: unchanged.

    Returns:
        ``[T, Hq, D]`` in q's dtype. q, k, v and kv_blocks share one dtype and device.
    """
    return torch.ops.kvgraph.ragged_attention(
        q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, layer_idx, scale,
        sliding_window, softcap,
    )


def cpu_implementation() -> str:
    """``"cpp"`` or ``"sdpa"``: what serves the op on CPU tensors in this process (chosen on first use)."""
    from kvgraph.ops import cpp, cpu

    global _cpu_kernel
    if _cpu_kernel is None:
        _cpu_kernel = cpp.ragged_attention if cpp.available() else cpu.ragged_attention
    return "cpp" if _cpu_kernel.__module__ == cpp.__name__ else "sdpa"


@torch.library.impl(_LIB, "ragged_attention", "CPU")
def _ragged_attention_cpu(*args, **kwargs) -> torch.Tensor:
    """CPU: the C++ paged kernel, or the SDPA path where it cannot be built (same arguments)."""
    if _cpu_kernel is None:
        cpu_implementation()
    return _cpu_kernel(*args, **kwargs)


@torch.library.impl(_LIB, "ragged_attention", "CUDA")
def _ragged_attention_cuda(*args, **kwargs) -> torch.Tensor:
    """CUDA: the Triton kernels, same arguments (they validate with :func:`~kvgraph.ops.checks.check_inputs`)."""
    from kvgraph.ops.triton import ragged_attention as triton_ragged_attention

    return triton_ragged_attention(*args, **kwargs)


@torch.library.register_fake("kvgraph::ragged_attention", lib=_LIB)
def _ragged_attention_fake(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Shape-only impl for tracing: checks metadata, returns ``[T, Hq, D]`` like q."""
    check_inputs(q, *args, **kwargs)
    return q.new_empty(q.shape)
