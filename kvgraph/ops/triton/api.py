"""``ragged_attention``: the Triton implementation of ``kvgraph::ragged_attention``.

It takes exactly the custom op's arguments: it stores the new keys/values (one launch), then
runs flash-decoding when every sequence has one new token (``max_lengths[0, 0] == 1``, read
from the CPU tensor without a device sync) and the prefill kernel otherwise. It never calls
the op itself, so the op's CUDA implementation can call it.
"""

from __future__ import annotations

import torch

from kvgraph.ops.plan import StepPlan, with_op_arguments
from kvgraph.ops.schema import AttentionArgs
from kvgraph.ops.triton.checks import check_launch
from kvgraph.ops.triton.decode import choose_num_splits, launch_decode, multiprocessors
from kvgraph.ops.triton.launch import on_device
from kvgraph.ops.triton.layout import PagedLayer
from kvgraph.ops.triton.prefill import launch_prefill
from kvgraph.ops.triton.store import launch_store


def run(args: AttentionArgs, plan: StepPlan) -> torch.Tensor:
    """Store the new tokens' K/V into the cache, then causal attention over each sequence's cache,
    on arguments checked against ``plan`` (shapes as :class:`~kvgraph.ops.schema.AttentionArgs`;
    layer ``layer_idx`` of ``kv_blocks`` is written in place).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype: token ``i`` of sequence ``b`` (at position
        ``pos = cache_lengths[b] + i - input_row_offsets[b]``) attends to positions ``0..pos``,
        or ``max(0, pos - w + 1)..pos`` with a sliding window; the cache keeps every position.

    Raises:
        CacheInputError: a shape, dtype, device or layout the kernels cannot take; nothing is written.
    """
    launch = check_launch(args, plan)
    q, cache_lengths, input_row_offsets = args.q, args.cache_lengths, args.input_row_offsets
    cache = PagedLayer.of(args.kv_blocks, args.lookup_table, args.layer_idx, args.kv_scales)
    with on_device(q):
        launch_store(args.k, args.v, cache, cache_lengths, input_row_offsets)
        if launch.max_new == 1:
            splits = choose_num_splits(plan.batch, plan.n_kv_heads, launch.max_keys, multiprocessors(q.device))
            return launch_decode(q, cache, cache_lengths, input_row_offsets, launch.scale, splits, launch.window,
                                 launch.softcap)
        return launch_prefill(q, cache, cache_lengths, input_row_offsets, launch.scale, launch.window,
                              launch.softcap)


ragged_attention = with_op_arguments(run)
