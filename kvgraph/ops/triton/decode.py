"""Launch wrapper of flash-decoding: split kernel, then reduction kernel."""

from __future__ import annotations

import functools
import math

import torch
import triton

from kvgraph.errors import CacheInputError
from kvgraph.ops.plan import plan_for
from kvgraph.ops.schema import AttentionArgs
from kvgraph.ops.triton.checks import check_launch
from kvgraph.ops.triton.decode_kernel import decode_reduce_kernel, decode_split_kernel
from kvgraph.ops.triton.launch import dot_constexprs, log2_softcap, on_device
from kvgraph.ops.triton.layout import MIN_DOT, PagedLayer, next_power_of_2, padded_head_dim
from kvgraph.ops.triton.store import launch_store

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # fewer positions per split cost more in the reduction than they save
WAVES = 2  # programs to aim for, in multiples of the multiprocessor count


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU interpreter."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, n_kv_heads: int, max_context: int, multiprocessors: int) -> int:
    """Splits per sequence so that ``batch * n_kv_heads * splits`` programs fill ``WAVES`` waves of
    the device, without splitting the longest context below ``MIN_SPLIT_TOKENS`` positions per split.
    An empty batch (no programs to launch) is sized like one sequence of one KV head."""
    by_occupancy = triton.cdiv(WAVES * multiprocessors, max(1, batch * n_kv_heads))
    by_length = triton.cdiv(max_context, MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode_attention(*args: object, num_splits: int | None = None, **kwargs: object) -> torch.Tensor:
    """The op (its arguments, :class:`~kvgraph.ops.schema.AttentionArgs`, and its cache writes) with
    flash-decoding: at most one new token per sequence (``max_lengths[0, 0] == 1``).

    Stores the new K/V, then splits each context (its last ``sliding_window`` positions with a
    window) into ``num_splits`` shares (chosen from the device and ``max_lengths[0, 1]``, or the
    window where shorter, when None) attended by separate programs and merged by a reduction
    kernel; scores are soft-capped with ``softcap``. Returns ``[T, Hq, D]`` in ``q``'s dtype.
    """
    op_args = AttentionArgs(*args, **kwargs)
    plan = plan_for(op_args)
    launch = check_launch(op_args, plan)
    q = op_args.q
    if q.shape[0] > 0 and launch.max_new != 1:
        raise CacheInputError(f"decode needs one new token per sequence, got max_lengths[0, 0] = {launch.max_new}")
    if num_splits is None:
        num_splits = choose_num_splits(plan.batch, plan.n_kv_heads, launch.max_keys, multiprocessors(q.device))
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise CacheInputError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    cache = PagedLayer.of(op_args.kv_blocks, op_args.lookup_table, op_args.layer_idx, op_args.kv_scales)
    with on_device(q):
        launch_store(op_args.k, op_args.v, cache, op_args.cache_lengths, op_args.input_row_offsets)
        return launch_decode(q, cache, op_args.cache_lengths, op_args.input_row_offsets, launch.scale, num_splits,
                             launch.window, launch.softcap)


def launch_decode(
    q: torch.Tensor,
    cache: PagedLayer,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    scale: float,
    num_splits: int,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launch the split and reduction kernels on validated inputs, over a cache already holding
    the new tokens.

    q: ``[T, Hq, D]``, at most one token per sequence; cache_lengths: ``int32 [batch]`` tokens
    cached *before* the new one; input_row_offsets: ``int32 [batch + 1]``; window: keys each
    token sees, 0 for all before it (:attr:`LaunchPlan.window`); softcap: scores ``s`` become
    ``softcap * tanh(s / softcap)``, None leaves them (and the compiled kernel) unchanged.
    Returns ``[T, Hq, D]``.
    """
    num_tokens, n_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    batch = cache_lengths.shape[0]
    n_kv_heads = cache.layer.shape[3]
    group = n_heads // n_kv_heads
    head_dim_pad = padded_head_dim(head_dim)
    # partial states, indexed by the sequence's token row
    part_acc = torch.empty(num_tokens, n_heads, num_splits, head_dim_pad, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_tokens, n_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)

    decode_split_kernel[(batch, n_kv_heads, num_splits)](
        q, part_acc, part_max, part_sum, *cache.kernel_args(), cache_lengths, input_row_offsets,
        q.stride(0), q.stride(1), *part_acc.stride()[:3], *part_max.stride()[:2],
        num_splits, scale * math.log2(math.e), window, log2_softcap(softcap),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group,
        BLOCK_H=max(MIN_DOT, next_power_of_2(group)), PAGE_SIZE=cache.page_size,
        HAS_SOFTCAP=softcap is not None, **dot_constexprs(q.dtype, cache), **cache.read_constexprs(),
    )
    decode_reduce_kernel[(batch, n_heads)](
        out, part_acc, part_max, part_sum, input_row_offsets,
        out.stride(0), out.stride(1), *part_acc.stride()[:3], *part_max.stride()[:2],
        num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
