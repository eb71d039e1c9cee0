"""Launch wrapper of the KV store kernel: one launch writes both K and V of a ragged batch."""

from __future__ import annotations

import torch

from kvgraph.ops.plan import plan_for
from kvgraph.ops.schema import AttentionArgs
from kvgraph.ops.triton.checks import check_launch
from kvgraph.ops.triton.launch import block_programs, on_device
from kvgraph.ops.triton.layout import PagedLayer, padded_head_dim
from kvgraph.ops.triton.store_kernel import store_kv_kernel

BLOCK_T = 16  # new tokens per program


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    layer_idx: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write the new tokens' keys and values into layer ``layer_idx`` of the cache, in place.

    Args:
        k, v: ``[T, Hkv, D]`` new keys/values in the cache dtype, contiguous along D.
        kv_blocks: paged ``[total_num_pages, 2, num_layers, page_size, Hkv, D]`` or continuous
            ``[max_batch_size, 2, num_layers, max_seq_len, Hkv, D]``; written in place.
        cache_lengths: ``int32 [batch]`` tokens cached before this step.
        lookup_table: ``int32 [batch, max_num_pages]`` (paged) or ``[batch]`` (continuous).
        input_row_offsets: ``int32 [batch + 1]`` prefix sums of new tokens per sequence.
        max_lengths: ``int32 [num_steps, 2]`` on the CPU, as for the op (only validated).
        layer_idx: the layer to write.
        kv_scales: a quantized cache's scales (``kv_blocks`` int8 or float8_e4m3fn): the new rows
            are quantized and their scales written here, in place.

    Token ``i`` of sequence ``b`` lands at position ``cache_lengths[b] + i - input_row_offsets[b]``.
    """
    # k stands in for the queries the op would take: the store reads none
    args = AttentionArgs(k, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, layer_idx,
                         kv_scales=kv_scales)
    check_launch(args, plan_for(args))
    with on_device(k):
        launch_store(k, v, PagedLayer.of(kv_blocks, lookup_table, layer_idx, kv_scales), cache_lengths,
                     input_row_offsets)


def launch_store(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedLayer,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
) -> None:
    """Launch :func:`store_kv_kernel` on validated inputs (see :func:`store_kv`). Without fp
    fusion: the quantized path's rounding must not be fused with the product before it."""
    num_tokens, n_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    batch = cache_lengths.shape[0]
    grid = (block_programs(num_tokens, batch, BLOCK_T), n_kv_heads)
    store_kv_kernel[grid](
        k, v, *cache.kernel_args(), cache_lengths, input_row_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        batch, cache.num_pages,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded_head_dim(head_dim), PAGE_SIZE=cache.page_size,
        **cache.quant_constexprs(), BLOCK_T=BLOCK_T, num_warps=2, enable_fp_fusion=False,
    )
