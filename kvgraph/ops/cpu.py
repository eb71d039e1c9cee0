"""CPU fast path of ``kvgraph::ragged_attention``.

Same first half as the reference (one ``index_put_`` per K and V into the cache, each
sequence's context gathered once), then one fused
:func:`torch.nn.functional.scaled_dot_product_attention` call over all sequences padded
to ``max_lengths[0]``, with an explicit causal-with-offset mask. GQA groups the query
heads of one kv head into the query-row dimension, so K/V are never repeated.
float16 is computed in float32: CPU SDPA has no fast half-precision kernel (bfloat16 it has).
SDPA cannot soft-cap scores, so with ``softcap`` the same padded batch is computed as
``softmax(c * tanh(QK^T * scale / c) + mask) V`` with matmuls, bfloat16 in float32 as well.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvgraph.ops.reference import store_and_load_context


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
    """The op on CPU tensors (arguments as ``torch.ops.kvgraph.ragged_attention``).

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``; kv_blocks: the cache (written in place);
        cache_lengths: int32 ``[batch]``; lookup_table: int32 ``[batch, max_num_pages]`` or ``[batch]``;
        input_row_offsets: int32 ``[batch + 1]``; max_lengths: int32 ``[steps, 2]``;
        sliding_window: keys each token sees, itself included (``None``: all before it);
        softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` (``None``: unchanged).

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    batch, k_ctx, v_ctx = store_and_load_context(
        q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, layer_idx, scale,
        sliding_window, softcap,
    )
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    B, S = batch.batch_size, batch.max_new
    # float16 in float32 (no fast CPU SDPA); bfloat16 too when soft-capping: the matmul path would
    # round the scores themselves to bfloat16 before the softmax
    low = (torch.float16,) if softcap is None else (torch.float16, torch.bfloat16)
    acc = torch.float32 if q.dtype in low else q.dtype
    # rows (s, g) of one kv head: [B, S, Hkv, G, D] -> [B, Hkv, S * G, D]
    q_rows = batch.pad(q).to(acc).view(B, S, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, S * G, D)
    mask = batch.mask(sliding_window).repeat_interleave(G, dim=1)[:, None]  # [B, 1, S * G, L]
    keys, values = k_ctx.to(acc).transpose(1, 2), v_ctx.to(acc).transpose(1, 2)  # [B, Hkv, L, D]
    if softcap is None:
        out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, S * G, D]
    else:
        scores = q_rows @ keys.transpose(-2, -1) * (1.0 / math.sqrt(D) if scale is None else scale)
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values
    out = out.view(B, Hkv, S, G, D).transpose(1, 2).reshape(B, S, Hq, D)
    return batch.unpad(out).to(q.dtype)
