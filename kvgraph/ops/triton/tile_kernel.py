"""``@triton.jit`` helpers shared by the store, prefill and decode kernels.

- :func:`locate_block` maps a program to (sequence, block of its new tokens) without a
  host-side schedule: block ``j`` of sequence ``b`` is program ``offs[b] // BLOCK + b + j``,
  so ``T // BLOCK + batch`` programs cover any ragged batch (surplus programs exit).
- :func:`lookup_pages` / :func:`kv_rows` turn positions of one sequence into cache offsets
  through the lookup table.
- :func:`window_start` is the first position a query sees under a sliding window.
- :func:`tanh` is fp32 ``tanh`` from ``exp2`` alone, for attention logit soft-capping.
- :func:`split_dot` is an fp32 matrix times 8-bit values on bf16 tensor cores.
- :func:`attend_tile` is one step of the online softmax over a tile of cached keys/values.
"""

import triton
import triton.language as tl


@triton.jit
def locate_block(RowOffsets, pid, batch, BLOCK: tl.constexpr):
    """Sequence ``b`` and block index ``j`` of program ``pid``.

    ``b`` is the last sequence whose first block ``offs[b] // BLOCK + b`` is ``<= pid``;
    ``j = pid - offs[b] // BLOCK - b`` may exceed the sequence's blocks (the caller exits).
    Returns ``(b, j, start, n_new)`` with ``start = offs[b]`` and ``n_new = offs[b+1] - offs[b]``.
    """
    lo: tl.int32 = 0
    hi = batch
    # -- binary search: largest b in [0, batch) with first_block(b) <= pid --
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = tl.load(RowOffsets + mid) // BLOCK + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid
    start = tl.load(RowOffsets + lo)
    n_new = tl.load(RowOffsets + lo + 1) - start
    return lo, pid - start // BLOCK - lo, start, n_new


@triton.jit
def lookup_pages(Lookup, pos, valid, stride_lut_p, PAGE_SIZE: tl.constexpr):
    """Physical pages (int64) of positions ``pos`` of one sequence; masked-off positions give 0.

    ``Lookup`` points at the sequence's lookup row.
    """
    page = tl.load(Lookup + (pos // PAGE_SIZE) * stride_lut_p, mask=valid, other=0)
    return page.to(tl.int64)


@triton.jit
def kv_rows(page, pos, stride_page, stride_row, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of the cache rows of positions ``pos`` held in pages ``page``."""
    return page * stride_page + (pos % PAGE_SIZE).to(tl.int64) * stride_row


@triton.jit
def window_start(pos, window):
    """First position seen by a query at ``pos`` (scalar or tensor): ``max(0, pos - window + 1)``
    with a sliding window of ``window`` keys, 0 without one (``window == 0``)."""
    return tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)


@triton.jit
def tanh(x):
    """``tanh`` of fp32 ``x`` from ``exp2`` alone (no libdevice, which the interpreter lacks).

    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)``, which never overflows, and the odd Taylor
    polynomial to ``x**9`` for ``|x| < 1/4``, where ``1 - e`` would cancel: a few ulps throughout.
    """
    a = tl.abs(x)
    e = tl.exp2(a * -2.8853900817779268)  # exp(-2|x|): -2 * log2(e)
    far = (1.0 - e) / (1.0 + e)
    a_near = tl.minimum(a, 0.25)  # keeps the unused polynomial finite for large |x|
    a2 = a_near * a_near
    near = a_near * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203))))
    t = tl.where(a < 0.25, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def split_dot(a, b, acc, PARTS: tl.constexpr):
    """``acc + a @ b`` for fp32 ``a`` and bf16 ``b`` whose values are exact in bf16 (8-bit cache
    entries: int8, or float8_e4m3fn's 3 mantissa bits), as ``PARTS`` bf16 dots: ``a`` is the sum
    of its bf16 roundings ``a_1 + a_2 + ...``, each of the rest left by the ones before. Three
    parts hold fp32's 24 significand bits, every product of bf16 values is exact in fp32, and the
    dots run on tensor cores instead of fp32 FMA (``input_precision="ieee"``)."""
    rest = a
    for _ in tl.static_range(PARTS):
        part = rest.to(tl.bfloat16)
        acc = tl.dot(part, b, acc)
        rest = rest - part.to(tl.float32)
    return acc


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, q_first, q_pos,
    K, V, KS, VS, Lookup, start_n, kv_end,
    stride_lut_p, stride_page, stride_row, stride_spage, stride_srow, qk_scale, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, QGROUP: tl.constexpr, SPLIT: tl.constexpr,
):
    """Fold keys/values at positions ``[start_n, start_n + BLOCK_N) ∩ [0, kv_end)`` into the state.

    acc: [M, HEAD_DIM_PAD] fp32 un-normalised output; m_i, l_i: [M] fp32 running max (log2
    units) and sum; q: [M, HEAD_DIM_PAD] in the cache dtype; q_first, q_pos: [M] int32 first and
    last position each query row sees, used when ``MASKED`` (keys outside ``[q_first, q_pos]``
    are masked; a row that has seen no key yet keeps max -inf and sum 0).
    ``K``/``V`` point at the key/value rows of this layer and KV head at page 0, row 0; with
    ``QUANT`` (an 8-bit cache) ``KS``/``VS`` point at their scales (``stride_spage``,
    ``stride_srow``; one per ``QGROUP`` elements). With one scale per row (``QGROUP == HEAD_DIM``,
    MAX's default granularity on heads of up to 128) the tile's 8-bit values go to the dot as they
    are (exact in q's dtype) and the row's scale multiplies its score and its probability: a
    per-element gather of scales made H100 decode 14x slower than an fp32 cache. Finer groups
    dequantize each tile to q's dtype once loaded (:mod:`kvgraph.ops.triton.quant_kernel`).
    ``SPLIT`` (one scale per row, fp32 queries; 0 otherwise) takes both products as that many bf16
    dots (:func:`split_dot`): with fp32 FMA dots such a cache decoded 7x slower than an fp32 one
    on an H100.
    ``DOT_PRECISION`` is ``launch.FP32_DOT_PRECISION`` (``"tf32x3"``) for fp32 operands: products as
    accurate as fp32's, on tensor cores.
    With ``HAS_SOFTCAP``, scores ``s`` become ``softcap * tanh(s / softcap)`` before masking; both
    are in log2 units (the cap times log2(e)), which is the true-scale ``c * tanh(s / c)`` times log2(e).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    kv_valid = offs_n < kv_end
    d_valid = offs_d < HEAD_DIM
    page = lookup_pages(Lookup, offs_n, kv_valid, stride_lut_p, PAGE_SIZE)
    rows = kv_rows(page, offs_n, stride_page, stride_row, PAGE_SIZE)  # [BLOCK_N]

    # -- load K tile transposed: [HEAD_DIM_PAD, BLOCK_N] --
    k = tl.load(K + rows[None, :] + offs_d[:, None], mask=d_valid[:, None] & kv_valid[None, :], other=0.0)
    if QUANT:
        srows = kv_rows(page, offs_n, stride_spage, stride_srow, PAGE_SIZE)  # [BLOCK_N]
        if QGROUP == HEAD_DIM:
            # one scale per row: 8-bit values are exact in q's dtype, the scale goes on the scores
            ks = tl.load(KS + srows, mask=kv_valid, other=0.0)  # [BLOCK_N]
            if SPLIT:  # through fp32: exact either way, and the interpreter's int8 -> bf16 is not
                k = k.to(tl.float32).to(tl.bfloat16)
            else:
                k = k.to(q.dtype)
        else:
            ks = tl.load(KS + srows[None, :] + (offs_d // QGROUP)[:, None],
                         mask=d_valid[:, None] & kv_valid[None, :], other=0.0)
            k = (k.to(tl.float32) * ks).to(q.dtype)
    if SPLIT:
        s = split_dot(q, k, tl.zeros((q.shape[0], BLOCK_N), tl.float32), SPLIT) * qk_scale
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, BLOCK_N]
    if QUANT:
        if QGROUP == HEAD_DIM:
            s = s * ks[None, :]
    if HAS_SOFTCAP:
        s = softcap * tanh(s / softcap)
    if MASKED:
        visible = kv_valid[None, :] & (offs_n[None, :] >= q_first[:, None]) & (offs_n[None, :] <= q_pos[:, None])
    else:
        visible = kv_valid[None, :]
    s = tl.where(visible, s, float("-inf"))

    # -- online softmax update --
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # rows with no visible key so far subtract 0, not -inf, so that they stay (-inf, 0), not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    # -- load V tile: [BLOCK_N, HEAD_DIM_PAD] and accumulate --
    v = tl.load(V + rows[:, None] + offs_d[None, :], mask=kv_valid[:, None] & d_valid[None, :], other=0.0)
    pv = p
    if QUANT:
        if QGROUP == HEAD_DIM:
            # one scale per row: it weighs the row's probability instead of each of its values
            pv = p * tl.load(VS + srows, mask=kv_valid, other=0.0)[None, :]
            if SPLIT:
                v = v.to(tl.float32).to(tl.bfloat16)
            else:
                v = v.to(q.dtype)
        else:
            vs = tl.load(VS + srows[:, None] + (offs_d // QGROUP)[None, :],
                         mask=kv_valid[:, None] & d_valid[None, :], other=0.0)
            v = (v.to(tl.float32) * vs).to(q.dtype)
    if SPLIT:
        acc = split_dot(pv, v, acc * alpha[:, None], SPLIT)
    else:
        acc = tl.dot(pv.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i
