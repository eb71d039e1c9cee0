"""The address helpers shared by the kernels: cache offsets past 2**31 elements stay exact."""

import torch
import triton
import triton.language as tl
from triton_cases import DEVICE

from kvgraph.kernels.triton.tile_kernel import kv_rows, lookup_pages


@triton.jit
def _offsets_kernel(Lookup, Out, n, stride_lut_p, stride_page, stride_row,
                    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Out[i] = element offset of position i of the sequence whose lookup row is ``Lookup``."""
    pos = tl.arange(0, BLOCK)
    valid = pos < n
    page = lookup_pages(Lookup, pos, valid, stride_lut_p, PAGE_SIZE)
    tl.store(Out + pos, kv_rows(page, pos, stride_page, stride_row, PAGE_SIZE), mask=valid)


def test_cache_offsets_of_high_pages_do_not_wrap_at_int32():
    # 32k-token contexts in 16-row pages over a pool of 2**17 pages, one page 2**16 elements apart:
    # page * stride_page reaches 2**33, far beyond int32, while every argument fits int32
    page_size, stride_page, stride_row = 16, 1 << 16, 1024
    lookup = torch.tensor([5, (1 << 17) - 1, 1 << 16, 3], dtype=torch.int32, device=DEVICE)
    n = 4 * page_size - 3
    out = torch.full((64,), -1, dtype=torch.int64, device=DEVICE)
    _offsets_kernel[(1,)](lookup, out, n, 1, stride_page, stride_row, PAGE_SIZE=page_size, BLOCK=64)

    pos = torch.arange(n)
    pages = lookup.cpu().long()[pos // page_size]
    expected = pages * stride_page + (pos % page_size) * stride_row
    assert expected.max() > 2**33 - 2**17
    assert torch.equal(out[:n].cpu(), expected)
    assert torch.equal(out[n:].cpu(), torch.full((64 - n,), -1, dtype=torch.int64))
