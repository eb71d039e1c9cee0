"""The CPU implementations against the float64 golden and the reference: the C++ paged kernel
(pages read in place) and the SDPA path (padded sequences, the fallback)."""

from __future__ import annotations

import pytest
import torch

from kvgraph.kernels import cpp, cpu, reference

IMPLS = {"cpp": cpp.ragged_attention, "sdpa": cpu.ragged_attention}


@pytest.fixture(params=list(IMPLS))
def impl(request):
    """One CPU implementation of the op (same arguments)."""
    return IMPLS[request.param]


def run_both(impl, case, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(fast path output, reference output), each on its own copy of the cache."""
    fast = impl(*case.clone().args(), **kwargs)
    ref = reference.ragged_attention(*case.clone().args(), **kwargs)
    return fast, ref


def test_matches_golden(impl, make_kv_case, check_against_golden, ragged_lengths, cache_page_size):
    case = make_kv_case(ragged_lengths, page_size=cache_page_size)
    fast, ref = run_both(impl, case)
    assert fast.dtype == case.q.dtype
    check_against_golden(fast, case.golden(), ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_dtypes(impl, make_kv_case, check_against_golden, dtype, page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9), (3, 1)], page_size=page_size, dtype=dtype)
    fast, ref = run_both(impl, case)
    assert fast.dtype == dtype
    check_against_golden(fast, case.golden(), ref)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "gqa8"])
@pytest.mark.parametrize("lengths", [[(9, 1), (30, 1)], [(6, 17), (0, 5)]], ids=["decode", "prefill"])
def test_gqa_ratios(impl, make_kv_case, check_against_golden, n_heads, n_kv_heads, lengths):
    case = make_kv_case(lengths, n_heads=n_heads, n_kv_heads=n_kv_heads)
    fast, ref = run_both(impl, case)
    check_against_golden(fast, case.golden(), ref)


def test_scale_argument(impl, make_kv_case, check_against_golden):
    case = make_kv_case([(11, 3), (0, 5)])
    fast, ref = run_both(impl, case, scale=0.37)
    check_against_golden(fast, case.golden(scale=0.37), ref)


def test_stores_exactly_the_new_rows(impl, make_kv_case, cache_page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=cache_page_size)
    before = case.kv_blocks.clone()
    impl(*case.args())
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_never_reads_outside_the_context(impl, make_kv_case, check_against_golden, page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=page_size, fill=float("nan"))
    fast, ref = run_both(impl, case)
    check_against_golden(fast, case.golden(), ref)


def test_longer_padding_than_needed(impl, make_kv_case, check_against_golden):
    """max_lengths may overstate the batch (e.g. a later step of a multistep run): same answer."""
    case = make_kv_case([(5, 2), (12, 1)])
    exact, ref = run_both(impl, case)
    case.max_lengths = case.max_lengths + torch.tensor([[3, 20]], dtype=torch.int32)
    padded = impl(*case.clone().args())
    check_against_golden(padded, case.golden(), ref)
    torch.testing.assert_close(padded, exact)


@pytest.mark.parametrize("head_dim", [20, 64, 80])
def test_head_dims(impl, make_kv_case, check_against_golden, head_dim):
    """Head sizes that are (64, 80) and are not (20) a multiple of the SIMD width, with GQA 4."""
    case = make_kv_case([(37, 1), (5, 19), (0, 3)], n_heads=8, n_kv_heads=2, head_dim=head_dim)
    fast, ref = run_both(impl, case)
    check_against_golden(fast, case.golden(), ref)


def test_strided_inputs(impl, make_kv_case, check_against_golden):
    """q/k/v as views of one fused projection (strided tokens and heads), as a captured graph passes them."""
    case = make_kv_case([(21, 1), (0, 18), (6, 5)], n_heads=4, n_kv_heads=2)
    fused = torch.cat([case.q, case.k, case.v], dim=1)  # [T, Hq + 2 * Hkv, D]
    case.q, case.k, case.v = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    assert not case.q.is_contiguous()
    fast, ref = run_both(impl, case)
    check_against_golden(fast, case.golden(), ref)
    before = case.kv_blocks.clone()
    impl(*case.args())
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
