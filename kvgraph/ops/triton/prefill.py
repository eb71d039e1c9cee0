"""Launch wrapper of the prefill / mixed-batch attention kernel."""

from __future__ import annotations

import math

import torch

from kvgraph.ops.plan import StepPlan, with_op_arguments
from kvgraph.ops.schema import AttentionArgs
from kvgraph.ops.triton.checks import check_launch
from kvgraph.ops.triton.launch import block_programs, dot_constexprs, log2_softcap, on_device
from kvgraph.ops.triton.layout import PagedLayer, next_power_of_2, padded_head_dim
from kvgraph.ops.triton.prefill_kernel import prefill_kernel
from kvgraph.ops.triton.store import launch_store


def _prefill(args: AttentionArgs, plan: StepPlan) -> torch.Tensor:
    """The op (same arguments, same cache writes) with the prefill kernel, whatever the batch.

    Stores the new K/V, then tiles of new tokens of each sequence attend causally to their
    new tokens and fully to the cached prefix (to its last ``sliding_window`` positions with a
    window), their scores soft-capped with ``softcap``. Arguments as
    :class:`~kvgraph.ops.schema.AttentionArgs`; returns ``[T, Hq, D]`` in ``q``'s dtype.
    """
    launch = check_launch(args, plan)
    cache = PagedLayer.of(args.kv_blocks, args.lookup_table, args.layer_idx, args.kv_scales)
    with on_device(args.q):
        launch_store(args.k, args.v, cache, args.cache_lengths, args.input_row_offsets)
        return launch_prefill(args.q, cache, args.cache_lengths, args.input_row_offsets, launch.scale, launch.window,
                              launch.softcap)


prefill_attention = with_op_arguments(_prefill)


def launch_prefill(
    q: torch.Tensor,
    cache: PagedLayer,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launch :func:`prefill_kernel` on validated inputs, over a cache already holding the new tokens.

    q: ``[T, Hq, D]``; cache_lengths: ``int32 [batch]`` tokens cached *before* the new ones;
    input_row_offsets: ``int32 [batch + 1]``; window: keys each token sees, 0 for all before it
    (:attr:`LaunchPlan.window`); softcap: scores ``s`` become ``softcap * tanh(s / softcap)``,
    None leaves them (and the compiled kernel) unchanged. Returns ``[T, Hq, D]`` in q's dtype.
    """
    num_tokens, n_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    batch = cache_lengths.shape[0]
    n_kv_heads = cache.layer.shape[3]
    group = n_heads // n_kv_heads

    def grid(meta: dict) -> tuple[int, int]:
        return block_programs(num_tokens, batch, meta["BLOCK_Q"]), n_kv_heads

    prefill_kernel[grid](
        q, out, *cache.kernel_args(), cache_lengths, input_row_offsets,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        batch, scale * math.log2(math.e), window, log2_softcap(softcap),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim),
        GROUP=group, GROUP_PAD=next_power_of_2(group), PAGE_SIZE=cache.page_size,
        HAS_SOFTCAP=softcap is not None, **dot_constexprs(q.dtype, cache), **cache.read_constexprs(),
    )
    return out
