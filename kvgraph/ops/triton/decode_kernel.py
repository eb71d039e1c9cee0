"""``@triton.jit`` flash-decoding: one new token per sequence, the context split across programs.

:func:`decode_split_kernel` attends each (sequence, KV head, split) over its share of the
context and writes an un-normalised partial output with its running max and sum;
:func:`decode_reduce_kernel` merges the splits of each (sequence, query head).
"""

import triton
import triton.language as tl

from kvgraph.ops.triton.configs import DECODE_KEY, autotuned, decode_configs, prune_decode
from kvgraph.ops.triton.tile_kernel import attend_tile, window_start


@triton.autotune(configs=decode_configs(), key=DECODE_KEY,
                 prune_configs_by={"early_config_prune": autotuned(prune_decode)})
@triton.jit(do_not_specialize=["window"])  # one compiled variant whatever the window
def decode_split_kernel(
    Q, PartAcc, PartMax, PartSum,
    Cache, Lookup, stride_lut_b, stride_lut_p, stride_page, stride_kv, stride_row, stride_head,
    Scales, stride_spage, stride_skv, stride_srow, stride_shead,
    CacheLengths, RowOffsets,
    stride_qt, stride_qh, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
    num_splits, qk_scale, window, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, QGROUP: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (sequence, KV head, split): attention of the sequence's query, for every query head
    of the KV head, over one contiguous share of the positions it sees: all of them, or its
    last ``window`` when ``window > 0`` (a sliding window).

    Q: [T, Hq, D]; Cache: one layer ``[num_pages, 2, page_size, Hkv, D]`` already holding the new
    token (8-bit with its ``Scales`` when ``QUANT``, one per ``QGROUP`` elements). PartAcc: fp32
    [T, Hq, num_splits, HEAD_DIM_PAD] un-normalised outputs; PartMax, PartSum: fp32
    [T, Hq, num_splits] running max (log2 units) and sum; an empty split writes
    (-inf, 0, zeros). A sequence with no new token is skipped. qk_scale: softmax scale times
    log2(e); softcap: with ``HAS_SOFTCAP``, the logit cap times log2(e), unused otherwise.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(RowOffsets + b)
    n_new = tl.load(RowOffsets + b + 1) - start
    if n_new == 0:
        return
    seq_len = tl.load(CacheLengths + b) + n_new
    first = window_start(seq_len - 1, window)  # the query's first visible position

    # -- this split's positions: [lo, hi), a whole number of BLOCK_N tiles from the first visible
    # one, so keys before a sliding window are neither read nor masked --
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    # -- load the queries of the group: [BLOCK_H, HEAD_DIM_PAD] --
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + offs_h
    h_valid = offs_h < GROUP
    tok_row = start.to(tl.int64)
    q_mask = h_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + tok_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = tl.full([BLOCK_H], seq_len - 1, dtype=tl.int32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    K = Cache + kv_head * stride_head
    V = K + stride_kv
    KS = Scales + kv_head * stride_shead
    VS = KS + stride_skv
    lut = Lookup + b * stride_lut_b
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, q_pos, K, V, KS, VS, lut, start_n, hi,
            stride_lut_p, stride_page, stride_row, stride_spage, stride_srow, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION, HAS_SOFTCAP, QUANT, QGROUP, SPLIT,
        )

    # -- write the partial state --
    part = tok_row * stride_mt + head * stride_mh + split
    tl.store(PartMax + part, m_i, mask=h_valid)
    tl.store(PartSum + part, l_i, mask=h_valid)
    acc_rows = tok_row * stride_at + head * stride_ah + split * stride_as
    tl.store(PartAcc + acc_rows[:, None] + offs_d[None, :], acc, mask=h_valid[:, None])


@triton.jit
def decode_reduce_kernel(
    Out, PartAcc, PartMax, PartSum, RowOffsets,
    stride_ot, stride_oh, stride_at, stride_ah, stride_as, stride_mt, stride_mh,
    num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Program (sequence, query head): merge the ``num_splits`` partial states into Out [T, Hq, D]."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(RowOffsets + b)
    if tl.load(RowOffsets + b + 1) == start:
        return
    tok_row = start.to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < num_splits

    # -- rescale every split to the common max --
    part = tok_row * stride_mt + head * stride_mh + offs_s
    m_s = tl.load(PartMax + part, mask=s_valid, other=float("-inf"))  # [SPLITS_PAD]
    l_s = tl.load(PartSum + part, mask=s_valid, other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, 0))  # split 0 is never empty, so the max is finite
    acc_rows = tok_row * stride_at + head * stride_ah + offs_s * stride_as
    acc = tl.load(PartAcc + acc_rows[:, None] + offs_d[None, :], mask=s_valid[:, None], other=0.0)

    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)  # [HEAD_DIM_PAD]
    tl.store(Out + tok_row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
