"""The helpers shared by the kernels: cache offsets past 2**31 elements stay exact; the
soft-capping ``tanh`` is accurate to a few ulps from tiny to huge arguments; fp32 times 8-bit
values as bf16 dots is as exact as fp32 products."""

import pytest
import torch
import triton
import triton.language as tl

from kvgraph.ops.triton.tile_kernel import kv_rows, lookup_pages, split_dot, tanh
from tests.ops.triton.triton_cases import DEVICE, gpu


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


@triton.jit
def _tanh_kernel(X, Out, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    tl.store(Out + offs, tanh(tl.load(X + offs, mask=valid, other=0.0)), mask=valid)


def test_tanh_is_accurate_near_zero_and_saturates_without_overflow():
    # subnormal to overflow-range arguments, both sides of the 1/4 switch, both signs, infinities
    mags = [0.0, 1e-40, 1e-20, 1e-6, 1e-3, 0.1, 0.2499, 0.25, 0.2501, 0.5, 1.0, 2.0, 5.0, 9.0, 20.0, 88.0,
            100.0, 1e4, 1e30, float("inf")]
    x = torch.tensor(mags + [-m for m in mags], dtype=torch.float32, device=DEVICE)
    out = torch.full_like(x, float("nan"))
    _tanh_kernel[(1,)](x, out, x.numel(), BLOCK=64)
    expected = torch.tanh(x.double())
    assert not out.isnan().any()
    # within 4 ulps of the float64 value, relative even for tiny arguments (1 - exp(-2|x|) would
    # lose them all), and exactly +-1 once saturated
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=4 * torch.finfo(torch.float32).eps,
                               atol=torch.finfo(torch.float32).tiny)
    assert (out[x.abs() >= 20] == x[x.abs() >= 20].sign()).all()


@triton.jit
def _split_dot_kernel(A, B, Out, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, PARTS: tl.constexpr):
    rows, inner, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + rows[:, None] * K + inner[None, :])
    b = tl.load(B + inner[:, None] * N + cols[None, :]).to(tl.float32).to(tl.bfloat16)
    tl.store(Out + rows[:, None] * N + cols[None, :], split_dot(a, b, tl.zeros((M, N), tl.float32), PARTS))


@gpu  # the interpreter has no bf16 tl.dot (triton-lang/triton#11584)
@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_split_dot_of_fp32_and_8_bit_values_is_as_exact_as_fp32_products(storage):
    m, k, n = 16, 64, 16
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)  # every magnitude in each row
    if storage == torch.int8:
        b = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
    else:
        b = (torch.randn(k, n, generator=gen) * 100).to(storage)
    expected = a.double() @ b.double()
    bound = (a.double().abs() @ b.double().abs()) * k * torch.finfo(torch.float32).eps  # fp32 sums' error

    def run(parts: int) -> torch.Tensor:
        out = torch.full((m, n), float("nan"), device=DEVICE)
        _split_dot_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, M=m, K=k, N=n, PARTS=parts)
        return out.double().cpu()

    assert ((run(3) - expected).abs() <= bound).all()
    # one part is a bf16 dot: its rounding of ``a`` (2**-9 relative) shows, so the parts are what
    # make the difference
    assert ((run(1) - expected).abs() > bound).any()
