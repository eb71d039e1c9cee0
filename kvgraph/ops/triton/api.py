"""``ragged_attention``: the Triton implementation of ``kvgraph::ragged_attention``.

It takes exactly the custom op's arguments: it stores the new keys/values (one launch), then
runs flash-decoding when every sequence has one new token (``max_lengths[0, 0] == 1``, read
from the CPU tensor without a device sync) and the prefill kernel otherwise. It never calls
the op itself, so the op's CUDA implementation can call it.
"""

from __future__ import annotations

import torch

from kvgraph.ops.triton.checks import check_launch
from kvgraph.ops.triton.decode import choose_num_splits, launch_decode, multiprocessors
from kvgraph.ops.triton.launch import on_device
from kvgraph.ops.triton.layout import PagedLayer
from kvgraph.ops.triton.prefill import launch_prefill
from kvgraph.ops.triton.store import launch_store


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
    """Store the new tokens' K/V into the cache, then causal attention over each sequence's cache.

    Args:
        q: ``[T, Hq, D]`` new tokens of all sequences, flattened (ragged).
        k, v: ``[T, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        kv_blocks: paged ``[total_num_pages, 2, num_layers, page_size, Hkv, D]`` or continuous
            ``[max_batch_size, 2, num_layers, max_seq_len, Hkv, D]`` (axis 1: 0 = K, 1 = V);
            layer ``layer_idx`` is written in place.
        cache_lengths: ``int32 [batch]`` tokens cached before this step.
        lookup_table: ``int32 [batch, max_num_pages]`` (paged, unused entries ``total_num_pages``)
            or ``[batch]`` (continuous: ``b -> slot``).
        input_row_offsets: ``int32 [batch + 1]`` prefix sums of new tokens per sequence.
        max_lengths: ``int32 [num_steps, 2]`` on the CPU, row 0 ``[max new tokens, max cached + new]``.
        layer_idx: the layer of this attention.
        scale: softmax scale, ``1/sqrt(D)`` when None.
        sliding_window: ``w >= 1`` keys each token sees, itself included; None: all before it.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before softmax (logit
            soft-capping); None: unchanged.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype: token ``i`` of sequence ``b`` (at position
        ``pos = cache_lengths[b] + i - input_row_offsets[b]``) attends to positions ``0..pos``,
        or ``max(0, pos - w + 1)..pos`` with a sliding window; the cache keeps every position.

    Raises:
        CacheInputError: a shape, dtype, device or layout the kernels cannot take; nothing is written.
    """
    plan = check_launch(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths,
                        layer_idx, scale, sliding_window, softcap)
    cache = PagedLayer.of(kv_blocks, lookup_table, layer_idx)
    with on_device(q):
        launch_store(k, v, cache, cache_lengths, input_row_offsets)
        if plan.max_new == 1:
            splits = choose_num_splits(cache_lengths.shape[0], k.shape[1], plan.max_keys,
                                       multiprocessors(q.device))
            return launch_decode(q, cache, cache_lengths, input_row_offsets, plan.scale, splits, plan.window,
                                 plan.softcap)
        return launch_prefill(q, cache, cache_lengths, input_row_offsets, plan.scale, plan.window, plan.softcap)
