"""The CPU implementations against the float64 golden and the reference: the C++ paged kernel
(pages read in place) and the SDPA path (padded sequences, the fallback)."""

from __future__ import annotations

import pytest
import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops import cpp, cpu, reference
from tests.naming import raises_naming

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


# -- sliding window: the token at position p sees only positions p - w + 1..p --

# (cached, new) tokens per sequence. Prompts span several 16-token query blocks and 64-key tiles;
# a 3-token sequence has few enough rows (with GQA 4) for fp32 pages to be read in place.
WINDOW_LENGTHS = {
    "prefill": [(0, 97), (0, 40)],
    "prefill_cached": [(45, 37), (130, 20), (50, 3)],
    "decode": [(200, 1), (5, 1), (0, 1), (64, 1)],
    "mixed": [(20, 1), (0, 17), (7, 9), (150, 1), (33, 40), (50, 3)],
}
# 1: only itself; 21 and 70: aligned to neither the 16-token pages nor the 64-key tiles;
# 10_000: longer than any context (plain causal)
WINDOWS = [1, 3, 21, 70, 10_000]


def hide_before_windows(case, window: int) -> None:
    """NaN at every cached position that no new token of its sequence sees (before the first one's window)."""
    for b, cached in enumerate(case.cache_lengths.tolist()):
        for pos in range(max(0, cached - window + 1)):
            block, row = case.location(b, pos)
            case.kv_blocks[block, :, case.layer_idx, row] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lengths", list(WINDOW_LENGTHS.values()), ids=list(WINDOW_LENGTHS))
def test_sliding_window_matches_golden(impl, make_kv_case, check_against_golden, lengths, window, page_size,
                                       dtype):
    case = make_kv_case(lengths, page_size=page_size, n_heads=8, n_kv_heads=2, dtype=dtype)
    fast, ref = run_both(impl, case, sliding_window=window)
    assert fast.dtype == dtype
    check_against_golden(fast, case.golden(sliding_window=window), ref)


@pytest.mark.parametrize("window", [1, 21])
def test_sliding_window_page_sizes(impl, make_kv_case, check_against_golden, cache_page_size, window):
    case = make_kv_case(WINDOW_LENGTHS["mixed"], page_size=cache_page_size)
    fast, ref = run_both(impl, case, sliding_window=window)
    check_against_golden(fast, case.golden(sliding_window=window), ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_sliding_window_other_dtypes(impl, make_kv_case, check_against_golden, dtype):
    case = make_kv_case(WINDOW_LENGTHS["mixed"], dtype=dtype)
    fast, ref = run_both(impl, case, sliding_window=21)
    assert fast.dtype == dtype
    check_against_golden(fast, case.golden(sliding_window=21), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 21])
def test_sliding_window_matches_the_reference(impl, make_kv_case, reference_tol, window, dtype):
    case = make_kv_case(WINDOW_LENGTHS["mixed"], n_heads=8, n_kv_heads=2, dtype=dtype)
    fast, ref = run_both(impl, case, sliding_window=window)
    # each is within reference_tol of the golden, so within twice that of the other
    torch.testing.assert_close(fast.double(), ref.double(), atol=2 * reference_tol[dtype], rtol=0)


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_sliding_window_longer_than_every_context_is_causal(impl, make_kv_case, page_size):
    case = make_kv_case(WINDOW_LENGTHS["mixed"], page_size=page_size)
    longest = int(case.max_lengths[0, 1])
    windowed = impl(*case.clone().args(), sliding_window=longest)
    torch.testing.assert_close(windowed, impl(*case.clone().args()), atol=0, rtol=0)


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_sliding_window_stores_exactly_the_new_rows(impl, make_kv_case, page_size):
    case = make_kv_case(WINDOW_LENGTHS["mixed"], page_size=page_size)
    before = case.kv_blocks.clone()
    impl(*case.args(), sliding_window=3)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
    ref = case.clone()
    ref.kv_blocks = before.clone()
    reference.ragged_attention(*ref.args(), sliding_window=3)
    assert torch.equal(case.kv_blocks, ref.kv_blocks)


@pytest.mark.parametrize("window", [0, -2])
def test_sliding_window_below_one_is_refused(impl, make_kv_case, window):
    case = make_kv_case([(20, 1), (0, 17)])
    before = case.kv_blocks.clone()
    with raises_naming(CacheInputError, "sliding_window", str(window)):
        impl(*case.args(), sliding_window=window)
    assert torch.equal(case.kv_blocks, before)


def test_cpp_kernel_refuses_a_window_below_one_before_writing(make_kv_case):
    """The C++ op's own check, for callers that skip the Python wrapper's."""
    case = make_kv_case([(20, 1), (0, 17)])
    cpp.build()
    before = case.kv_blocks.clone()
    with raises_naming(ValueError, "sliding_window", "0"):
        torch.ops.kvgraph_cpu.ragged_attention(*case.args(), None, 0)
    assert torch.equal(case.kv_blocks, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, None], ids=["page1", "page16", "continuous"])
@pytest.mark.parametrize("window", [1, 21, 70])
def test_cpp_never_reads_before_the_window(make_kv_case, check_against_golden, window, page_size, dtype):
    """Cached positions no new token sees hold NaN: the C++ kernel skips them (the reference and SDPA
    multiply them by zero, which NaN survives)."""
    case = make_kv_case(WINDOW_LENGTHS["mixed"] + [(300, 2)], page_size=page_size, n_heads=8, n_kv_heads=2,
                        dtype=dtype)
    ref = reference.ragged_attention(*case.clone().args(), sliding_window=window)
    hide_before_windows(case, window)
    fast = cpp.ragged_attention(*case.args(), sliding_window=window)
    check_against_golden(fast, case.golden(sliding_window=window), ref)


# -- softcap: each score s = scale * q.k becomes c * tanh(s / c) before softmax --

# (cached, new) tokens per sequence: prompts across several 16-token query blocks and 64-key tiles,
# with and without a cached prefix; decode over a long cache (the two-pass path); a mix of both
SOFTCAP_LENGTHS = {
    "prefill": [(0, 97), (0, 40)],
    "prefill_cached": [(45, 37), (130, 20), (50, 3)],
    "decode": [(300, 1), (5, 1), (0, 1), (64, 1)],
    "mixed": [(20, 1), (0, 17), (7, 9), (150, 1), (33, 40), (50, 3)],
}
# 1.0 caps nearly every score, 5.0 the large ones, 50.0 almost none
SOFTCAPS = [1.0, 5.0, 50.0]
# head_dim 16: with scale 1 the scores have std ~4, so the caps above bite to different degrees
SOFTCAP_SCALE = 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
@pytest.mark.parametrize("window", [None, 21], ids=["causal", "window21"])
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("lengths", list(SOFTCAP_LENGTHS.values()), ids=list(SOFTCAP_LENGTHS))
def test_softcap_matches_golden(impl, make_kv_case, check_against_golden, lengths, softcap, window, page_size,
                                dtype):
    case = make_kv_case(lengths, page_size=page_size, n_heads=8, n_kv_heads=2, dtype=dtype)
    kwargs = {"scale": SOFTCAP_SCALE, "sliding_window": window, "softcap": softcap}
    fast, ref = run_both(impl, case, **kwargs)
    assert fast.dtype == dtype
    check_against_golden(fast, case.golden(**kwargs), ref)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "gqa8"])
@pytest.mark.parametrize("batch", ["decode", "prefill_cached"], ids=["decode", "prefill"])
@pytest.mark.parametrize(("option", "lengths"), [({"sliding_window": 21}, WINDOW_LENGTHS),
                                                 ({"softcap": 1.0}, SOFTCAP_LENGTHS)], ids=["window", "softcap"])
def test_window_and_softcap_gqa_ratios(impl, make_kv_case, check_against_golden, n_heads, n_kv_heads, batch,
                                       option, lengths):
    """With the default scale 1 / sqrt(D)."""
    case = make_kv_case(lengths[batch], n_heads=n_heads, n_kv_heads=n_kv_heads)
    fast, ref = run_both(impl, case, **option)
    check_against_golden(fast, case.golden(**option), ref)


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
def test_softcap_page_sizes(impl, make_kv_case, check_against_golden, cache_page_size, window):
    case = make_kv_case(SOFTCAP_LENGTHS["mixed"], page_size=cache_page_size)
    kwargs = {"scale": SOFTCAP_SCALE, "sliding_window": window, "softcap": 5.0}
    fast, ref = run_both(impl, case, **kwargs)
    check_against_golden(fast, case.golden(**kwargs), ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_softcap_other_dtypes(impl, make_kv_case, check_against_golden, dtype):
    case = make_kv_case(SOFTCAP_LENGTHS["mixed"], dtype=dtype)
    kwargs = {"scale": SOFTCAP_SCALE, "softcap": 5.0}
    fast, ref = run_both(impl, case, **kwargs)
    assert fast.dtype == dtype
    check_against_golden(fast, case.golden(**kwargs), ref)


@pytest.mark.parametrize("head_dim", [20, 64, 80])
def test_softcap_head_dims(impl, make_kv_case, check_against_golden, head_dim):
    case = make_kv_case([(37, 1), (5, 19), (0, 3)], n_heads=8, n_kv_heads=2, head_dim=head_dim)
    fast, ref = run_both(impl, case, softcap=1.0)
    check_against_golden(fast, case.golden(softcap=1.0), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_the_reference(impl, make_kv_case, reference_tol, dtype):
    case = make_kv_case(SOFTCAP_LENGTHS["mixed"], n_heads=8, n_kv_heads=2, dtype=dtype)
    fast, ref = run_both(impl, case, scale=SOFTCAP_SCALE, softcap=5.0)
    torch.testing.assert_close(fast.double(), ref.double(), atol=2 * reference_tol[dtype], rtol=0)


@pytest.mark.parametrize("lengths", [SOFTCAP_LENGTHS["decode"], SOFTCAP_LENGTHS["prefill_cached"]],
                         ids=["decode", "prefill"])
def test_softcap_changes_the_output(impl, make_kv_case, lengths):
    """Scores large enough to be capped: the capped output is the capped golden's, far from the plain one."""
    case = make_kv_case(lengths, n_heads=8, n_kv_heads=2)
    capped = impl(*case.clone().args(), scale=SOFTCAP_SCALE, softcap=1.0)
    plain = impl(*case.clone().args(), scale=SOFTCAP_SCALE)
    assert (capped - plain).abs().max().item() > 0.1
    golden = case.golden(scale=SOFTCAP_SCALE, softcap=1.0).float()
    torch.testing.assert_close(capped, golden, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain, case.golden(scale=SOFTCAP_SCALE).float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_softcap_stores_exactly_the_new_rows(impl, make_kv_case, page_size):
    case = make_kv_case(SOFTCAP_LENGTHS["mixed"], page_size=page_size)
    before = case.kv_blocks.clone()
    impl(*case.args(), softcap=5.0, sliding_window=3)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_not_positive_is_refused(impl, make_kv_case, softcap):
    case = make_kv_case([(20, 1), (0, 17)])
    before = case.kv_blocks.clone()
    with raises_naming(CacheInputError, "softcap", repr(softcap)):
        impl(*case.args(), softcap=softcap)
    assert torch.equal(case.kv_blocks, before)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf")])
def test_cpp_kernel_refuses_a_softcap_not_positive_before_writing(make_kv_case, softcap):
    """The C++ op's own check, for callers that skip the Python wrapper's."""
    case = make_kv_case([(20, 1), (0, 17)])
    cpp.build()
    before = case.kv_blocks.clone()
    with raises_naming(ValueError, "softcap", f"{softcap:g}"):

        torch.ops.kvgraph_cpu.ragged_attention(*case.args(), None, None, softcap)
    assert torch.equal(case.kv_blocks, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, None], ids=["page1", "page16", "continuous"])
def test_cpp_softcap_never_reads_before_the_window(make_kv_case, check_against_golden, page_size, dtype):
    """NaN before every window: capped scores of keys a row does not see stay masked."""
    case = make_kv_case(WINDOW_LENGTHS["mixed"] + [(300, 2)], page_size=page_size, n_heads=8, n_kv_heads=2,
                        dtype=dtype)
    kwargs = {"scale": SOFTCAP_SCALE, "sliding_window": 21, "softcap": 5.0}
    ref = reference.ragged_attention(*case.clone().args(), **kwargs)
    hide_before_windows(case, 21)
    fast = cpp.ragged_attention(*case.args(), **kwargs)
    check_against_golden(fast, case.golden(**kwargs), ref)
