"""``@triton.jit`` kernel writing the new tokens' keys and values into their cache pages."""

import triton
import triton.language as tl

from kvgraph.ops.triton.quant_kernel import quantize_rows
from kvgraph.ops.triton.tile_kernel import kv_rows, locate_block, lookup_pages


@triton.jit
def store_kv_kernel(
    K, V,
    Cache, Lookup, stride_lut_b, stride_lut_p, stride_page, stride_kv, stride_row, stride_head,
    Scales, stride_spage, stride_skv, stride_srow, stride_shead,
    CacheLengths, RowOffsets,
    stride_kt, stride_kh, stride_vt, stride_vh,
    batch, num_pages,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, QGROUP: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (block of BLOCK_T new tokens of one sequence, KV head): copy their K and V rows,
    quantized with their scales into a quantized cache (``QUANT`` 1 int8, 2 float8_e4m3fn; see
    :mod:`kvgraph.ops.triton.quant_kernel`).

    K, V: [T, Hkv, D] new keys/values; Cache: one layer ``[num_pages, 2, page_size, Hkv, D]``;
    Scales: its ``[num_pages, 2, page_size, Hkv, GROUPS]`` scales when ``QUANT``;
    token ``i`` of sequence ``b`` goes to position ``cache_lengths[b] + i - offs[b]``.
    Lookup entries ``>= num_pages`` (unused pages) are never written.
    """
    head = tl.program_id(1)
    b, j, start, n_new = locate_block(RowOffsets, tl.program_id(0), batch, BLOCK_T)
    if j * BLOCK_T >= n_new:
        return
    offs_t = j * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token index within the sequence
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    t_valid = offs_t < n_new
    pos = tl.load(CacheLengths + b) + offs_t  # [BLOCK_T] positions in the cache

    # -- destination rows --
    page = lookup_pages(Lookup + b * stride_lut_b, pos, t_valid, stride_lut_p, PAGE_SIZE)
    rows = kv_rows(page, pos, stride_page, stride_row, PAGE_SIZE) + head * stride_head
    mask = (t_valid & (page < num_pages))[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok = (start + offs_t).to(tl.int64)  # [BLOCK_T] rows of k and v

    # -- copy K, then V --
    k = tl.load(K + tok[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(V + tok[:, None] * stride_vt + head * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if QUANT:
        d_valid = offs_d < HEAD_DIM
        offs_g = tl.arange(0, GROUPS_PAD)
        srows = kv_rows(page, pos, stride_spage, stride_srow, PAGE_SIZE) + head * stride_shead
        smask = (t_valid & (page < num_pages))[:, None] & (offs_g < GROUPS)[None, :]
        k, k_scales = quantize_rows(k.to(tl.float32), d_valid, QUANT, QMAX, QGROUP, GROUPS, GROUPS_PAD)
        v, v_scales = quantize_rows(v.to(tl.float32), d_valid, QUANT, QMAX, QGROUP, GROUPS, GROUPS_PAD)
        tl.store(Scales + srows[:, None] + offs_g[None, :], k_scales, mask=smask)
        tl.store(Scales + stride_skv + srows[:, None] + offs_g[None, :], v_scales, mask=smask)
    tl.store(Cache + rows[:, None] + offs_d[None, :], k, mask=mask)
    tl.store(Cache + stride_kv + rows[:, None] + offs_d[None, :], v, mask=mask)
