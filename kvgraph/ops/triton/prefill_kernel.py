"""``@triton.jit`` ragged paged flash attention for prefill and mixed batches."""

import triton
import triton.language as tl

from kvgraph.ops.triton.configs import PREFILL_KEY, autotuned, prefill_configs, prune_prefill
from kvgraph.ops.triton.tile_kernel import attend_tile, locate_block, window_start


@triton.autotune(configs=prefill_configs(), key=PREFILL_KEY,
                 prune_configs_by={"early_config_prune": autotuned(prune_prefill)})
@triton.jit(do_not_specialize=["window"])  # one compiled variant whatever the window
def prefill_kernel(
    Q, Out,
    Cache, Lookup, stride_lut_b, stride_lut_p, stride_page, stride_kv, stride_row, stride_head,
    Scales, stride_spage, stride_skv, stride_srow, stride_shead,
    CacheLengths, RowOffsets,
    stride_qt, stride_qh, stride_ot, stride_oh,
    batch, qk_scale, window, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, QGROUP: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (block of BLOCK_Q new tokens of one sequence, KV head): causal attention of the
    block's queries of every query head of that KV head over the sequence's cache, each query
    over its last ``window`` positions only when ``window > 0`` (a sliding window).

    Q, Out: [T, Hq, D]; Cache: one layer ``[num_pages, 2, page_size, Hkv, D]`` already holding the
    new tokens (8-bit with its ``Scales`` when ``QUANT``, one per ``QGROUP`` elements). Tile rows
    are (token, query head of the group) pairs, so each K/V tile is loaded once for the whole group.
    Query head ``kv_head * GROUP + g`` reads KV head ``kv_head``.
    qk_scale: softmax scale times log2(e); softcap: with ``HAS_SOFTCAP``, the logit cap times
    log2(e) (scores ``s`` become ``c * tanh(s / c)``), unused otherwise.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    kv_head = tl.program_id(1)
    b, j, start, n_new = locate_block(RowOffsets, tl.program_id(0), batch, BLOCK_Q)
    q0 = j * BLOCK_Q
    if q0 >= n_new:
        return
    cached = tl.load(CacheLengths + b)

    # -- load the query tile: [BLOCK_M, HEAD_DIM_PAD] --
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = q0 + offs_m // GROUP_PAD  # [BLOCK_M] token index within the sequence
    grp = offs_m % GROUP_PAD  # [BLOCK_M] query head within the group
    # [BLOCK_M] last and first position each row sees; rows past the new tokens (never stored)
    # take the last token's, so that every row sees a key
    q_pos = cached + tl.minimum(tok, n_new - 1)
    q_first = window_start(q_pos, window)
    head = kv_head * GROUP + grp
    mask = ((tok < n_new) & (grp < GROUP))[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok_row = (start + tok).to(tl.int64)
    q = tl.load(Q + (tok_row * stride_qt + head * stride_qh)[:, None] + offs_d[None, :], mask=mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    K = Cache + kv_head * stride_head
    V = K + stride_kv
    KS = Scales + kv_head * stride_shead
    VS = KS + stride_skv
    lut = Lookup + b * stride_lut_b

    # -- key tiles: row r sees [q_first[r], q_pos[r]], both growing with the token, so the block
    # reads from the tile of its first token's window start to its last token (kv_end - 1) --
    kv_end = cached + tl.minimum(q0 + BLOCK_Q, n_new)
    kv_start = window_start(cached + q0, window) // BLOCK_N * BLOCK_N  # no tile before it is seen
    full_end = (cached + q0 + 1) // BLOCK_N * BLOCK_N
    full_start = tl.minimum(tl.cdiv(window_start(kv_end - 1, window), BLOCK_N) * BLOCK_N, full_end)

    # -- phase 1: the window's leading edge, tiles that some rows' windows start after (masked) --
    for start_n in range(kv_start, full_start, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_first, q_pos, K, V, KS, VS, lut, start_n, full_start,
            stride_lut_p, stride_page, stride_row, stride_spage, stride_srow, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION, HAS_SOFTCAP, QUANT, QGROUP, SPLIT,
        )
    # -- phase 2: whole tiles inside every row's window and before the block's first position --
    for start_n in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_first, q_pos, K, V, KS, VS, lut, start_n, full_end,
            stride_lut_p, stride_page, stride_row, stride_spage, stride_srow, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION, HAS_SOFTCAP, QUANT, QGROUP, SPLIT,
        )
    # -- phase 3: the diagonal, up to the block's last new token, causally (and window) masked --
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_first, q_pos, K, V, KS, VS, lut, start_n, kv_end,
            stride_lut_p, stride_page, stride_row, stride_spage, stride_srow, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION, HAS_SOFTCAP, QUANT, QGROUP, SPLIT,
        )

    # -- epilogue: normalise and store --
    out = acc / l_i[:, None]
    tl.store(Out + (tok_row * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask)
