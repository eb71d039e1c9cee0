"""Ragged paged flash attention (prefill and mixed batches) against the fp64 golden."""

import pytest
import torch

from kvgraph.ops.triton import prefill_attention
from kvgraph.ops.triton.configs import prefill_configs
from tests.ops.triton.triton_cases import (
    BF16,
    DEVICE,
    gpu,
    hide_before,
    reference_output,
    windowed_golden,
)

# empty cache, long prompt over a cached prefix, page exactly full, one token, no new token,
# prefixes ending one and two positions before a 16-key tile boundary
MIXED = [(0, 17), (13, 97), (16, 16), (40, 1), (7, 0), (30, 5), (47, 20)]


def _check(case, check_against_golden, scale=None):
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale)
    out = prefill_attention(*case.args(), scale=scale)
    check_against_golden(out, case.golden(scale), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize(
    "head_dim, page_size, n_heads, n_kv_heads",
    [(64, 1, 4, 4), (80, 16, 4, 2), (96, 128, 8, 1), (128, 16, 6, 2), (256, None, 2, 1)],
)
def test_prefill_mixed_batch_matches_golden(make_kv_case, check_against_golden, head_dim, page_size,
                                            n_heads, n_kv_heads):
    case = make_kv_case(MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                        page_size=page_size, device=DEVICE)
    _check(case, check_against_golden)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_prefill_half_precision(make_kv_case, check_against_golden, dtype):
    case = make_kv_case(MIXED, head_dim=80, dtype=dtype, device=DEVICE)
    _check(case, check_against_golden)


def test_prefill_empty_cache_odd_prompts(make_kv_case, check_against_golden):
    case = make_kv_case([(0, 17), (0, 97), (0, 1)], n_heads=8, n_kv_heads=2, head_dim=64, device=DEVICE)
    _check(case, check_against_golden)


def test_prefill_scale_argument(make_kv_case, check_against_golden):
    case = make_kv_case([(5, 17)], head_dim=64, device=DEVICE)
    scaled = _check(case.clone(), check_against_golden, scale=0.3)
    assert not torch.allclose(scaled, prefill_attention(*case.args()), atol=1e-3)


def test_prefill_never_reads_rows_outside_the_sequences(make_kv_case, check_against_golden):
    # every row that holds no history is NaN: reading one would poison the output
    case = make_kv_case(MIXED, head_dim=64, page_size=16, fill=float("nan"), device=DEVICE)
    _check(case, check_against_golden)


def _check_window(case, check_against_golden, window, scale=None):
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale, window)
    out = prefill_attention(*case.args(), scale=scale, sliding_window=window)
    check_against_golden(out, windowed_golden(case, window, scale), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


# windows of one key, of a few, unaligned to pages and tiles (21, over a 16-token block), larger
# than every context (120 < the 128 positions the lookup table holds), larger than the cache
@pytest.mark.parametrize(
    "window, page_size, n_heads, n_kv_heads",
    [(1, 16, 4, 2), (3, 1, 4, 4), (21, 16, 6, 2), (21, None, 8, 1), (120, 16, 4, 2), (10**9, 128, 4, 2)],
)
def test_prefill_sliding_window_matches_golden(make_kv_case, check_against_golden, window, page_size,
                                               n_heads, n_kv_heads):
    case = make_kv_case(MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=32, page_size=page_size,
                        device=DEVICE)
    _check_window(case, check_against_golden, window)


def test_prefill_sliding_window_differs_from_causal(make_kv_case, check_against_golden):
    case = make_kv_case([(30, 20)], head_dim=32, device=DEVICE)
    windowed = _check_window(case.clone(), check_against_golden, 5, scale=0.3)
    assert not torch.allclose(windowed, prefill_attention(*case.args(), scale=0.3), atol=1e-3)


@pytest.mark.parametrize("window", [3, 40])
def test_prefill_sliding_window_skips_tiles_before_it(make_kv_case, check_against_golden, window):
    # positions in key tiles wholly before a sequence's first window start are NaN: reading any
    # poisons the output. The largest key tile bounds them for whichever tile autotuning picks
    lengths = [(150, 20), (70, 33), (0, 17)]
    case = make_kv_case(lengths, head_dim=32, page_size=16, device=DEVICE)
    ref, gold = reference_output(case, sliding_window=window), windowed_golden(case, window)
    tile = max(c.kwargs["BLOCK_N"] for c in prefill_configs())
    hide_before(case, [max(0, cached - window + 1) // tile * tile for cached, _ in lengths])
    out = prefill_attention(*case.args(), sliding_window=window)
    check_against_golden(out, gold, ref)


def _check_softcap(case, check_against_golden, softcap, window=None, scale=None):
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale, window, softcap)
    out = prefill_attention(*case.args(), scale=scale, sliding_window=window, softcap=softcap)
    check_against_golden(out, windowed_golden(case, window, scale, softcap), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


# caps that bend most scores (1) and only the largest (30, Gemma 2's), alone and under windows;
# paged, one-row pages and continuous caches; grouped and one-KV-head queries
@pytest.mark.parametrize(
    "softcap, window, page_size, n_heads, n_kv_heads",
    [(1.0, None, 16, 4, 2), (30.0, None, None, 8, 1), (30.0, None, 1, 4, 4), (1.0, 21, None, 6, 2),
     (30.0, 3, 16, 4, 2), (1.0, 120, 1, 8, 1)],
)
def test_prefill_softcap_matches_golden(make_kv_case, check_against_golden, softcap, window, page_size,
                                        n_heads, n_kv_heads):
    case = make_kv_case(MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=32, page_size=page_size,
                        device=DEVICE)
    _check_softcap(case, check_against_golden, softcap, window)


def test_prefill_softcap_half_precision(make_kv_case, check_against_golden):
    case = make_kv_case(MIXED, head_dim=64, dtype=torch.float16, device=DEVICE)
    _check_softcap(case, check_against_golden, 1.0, scale=0.5)


@pytest.mark.parametrize("softcap", [1.0, 30.0])
def test_prefill_softcap_bends_large_scores(make_kv_case, check_against_golden, softcap):
    # scale 2 puts scores around +-11: both caps move them, and with them the output
    case = make_kv_case([(30, 20), (0, 9)], head_dim=32, device=DEVICE)
    capped = _check_softcap(case.clone(), check_against_golden, softcap, scale=2.0)
    assert not torch.allclose(capped, prefill_attention(*case.args(), scale=2.0), atol=1e-2)


@gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_prefill_large_cuda(make_kv_case, check_against_golden, head_dim, page_size, dtype):
    # the reference pads to [batch, max new, max total]: keep that product a few GB
    lengths = [(0, 1024), (4000, 512), (777, 1), (2047, 129), (8191, 300)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=head_dim, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check(case, check_against_golden)


@gpu
@pytest.mark.parametrize("window", [1, 100, 1000, 4096])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_prefill_sliding_window_large_cuda(make_kv_case, check_against_golden, window, page_size, dtype):
    lengths = [(0, 1024), (4000, 512), (777, 1), (2047, 129), (8191, 300)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=128, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check_window(case, check_against_golden, window)


@gpu
@pytest.mark.parametrize("softcap, window", [(1.0, None), (30.0, None), (30.0, 1000), (50.0, 4096)])
@pytest.mark.parametrize("page_size", [1, 16, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_prefill_softcap_large_cuda(make_kv_case, check_against_golden, softcap, window, page_size, dtype):
    lengths = [(0, 1024), (4000, 512), (777, 1), (2047, 129), (8191, 300)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=128, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check_softcap(case, check_against_golden, softcap, window)
