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

from kvgraph.ops.plan import StepPlan, with_op_arguments
from kvgraph.ops.reference import store_and_load_context
from kvgraph.ops.schema import AttentionArgs


def run(args: AttentionArgs, plan: StepPlan) -> torch.Tensor:
    """The op on CPU tensors, on arguments checked against ``plan`` (shapes as
    :class:`~kvgraph.ops.schema.AttentionArgs`). The padded causal mask is built once per step.

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    batch, k_ctx, v_ctx = store_and_load_context(args, plan)
    q, scale, softcap = args.q, args.scale, args.softcap
    T, Hq, D = q.shape
    Hkv = args.k.shape[1]
    G = Hq // Hkv
    B, S = batch.batch_size, batch.max_new
    # float16 in float32 (no fast CPU SDPA); bfloat16 too when soft-capping: the matmul path would
    # round the scores themselves to bfloat16 before the softmax
    low = (torch.float16,) if softcap is None else (torch.float16, torch.bfloat16)
    acc = torch.float32 if q.dtype in low else q.dtype
    # rows (s, g) of one kv head: [B, S, Hkv, G, D] -> [B, Hkv, S * G, D]
    q_rows = batch.pad(q).to(acc).view(B, S, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, S * G, D)
    mask = plan.derived(  # [B, 1, S * G, L]
        ("sdpa mask", T, args.sliding_window, G),
        lambda: batch.mask(args.sliding_window).repeat_interleave(G, dim=1)[:, None],
    )
    keys, values = k_ctx.to(acc).transpose(1, 2), v_ctx.to(acc).transpose(1, 2)  # [B, Hkv, L, D]
    if softcap is None:
        out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, S * G, D]
    else:
        scores = q_rows @ keys.transpose(-2, -1) * (1.0 / math.sqrt(D) if scale is None else scale)
        scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values
    out = out.view(B, Hkv, S, G, D).transpose(1, 2).reshape(B, S, Hq, D)
    return batch.unpad(out).to(q.dtype)


ragged_attention = with_op_arguments(run)
