"""Flash-decoding (split context + reduction) against the fp64 golden, and the split heuristic."""

import pytest
import torch

import kvgraph.ops.triton.decode as decode
from kvgraph.errors import CacheInputError
from kvgraph.ops.triton import decode_attention
from kvgraph.ops.triton.decode import MAX_SPLITS, MIN_SPLIT_TOKENS, choose_num_splits
from tests.naming import raises_naming
from tests.ops.triton.triton_cases import (
    BF16,
    DEVICE,
    gpu,
    hide_before,
    reference_output,
    windowed_golden,
)

# empty cache, short, page exactly full after the step, long odd context, no new token
DECODE = [(0, 1), (5, 1), (15, 1), (96, 1), (8, 0)]


def _check(case, check_against_golden, num_splits, scale=None):
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale)
    out = decode_attention(*case.args(), scale=scale, num_splits=num_splits)
    check_against_golden(out, case.golden(scale), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_decode_split_k_matches_golden(make_kv_case, check_against_golden, num_splits):
    # 7 splits of a 97-position context: 16-key splits, the last one partial, short contexts
    # leave most splits empty
    case = make_kv_case(DECODE, n_heads=4, n_kv_heads=2, head_dim=80, page_size=16, device=DEVICE)
    _check(case, check_against_golden, num_splits)


@pytest.mark.parametrize(
    "head_dim, page_size, n_heads, n_kv_heads",
    [(64, 1, 2, 2), (96, 128, 8, 1), (128, None, 6, 2), (256, 16, 2, 1)],
)
def test_decode_shapes_match_golden(make_kv_case, check_against_golden, head_dim, page_size, n_heads, n_kv_heads):
    case = make_kv_case(DECODE, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                        page_size=page_size, device=DEVICE)
    _check(case, check_against_golden, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_decode_half_precision(make_kv_case, check_against_golden, dtype):
    case = make_kv_case(DECODE, head_dim=64, dtype=dtype, device=DEVICE)
    _check(case, check_against_golden, num_splits=4)


def test_decode_never_reads_rows_outside_the_sequences(make_kv_case, check_against_golden):
    case = make_kv_case(DECODE, head_dim=64, page_size=16, fill=float("nan"), device=DEVICE)
    _check(case, check_against_golden, num_splits=5)


def test_decode_scale_argument(make_kv_case, check_against_golden):
    case = make_kv_case([(40, 1)], head_dim=64, device=DEVICE)
    scaled = _check(case.clone(), check_against_golden, num_splits=2, scale=0.25)
    assert not torch.allclose(scaled, decode_attention(*case.args(), num_splits=2), atol=1e-3)


def _check_window(case, check_against_golden, window, num_splits):
    before = case.kv_blocks.clone()
    ref = reference_output(case, sliding_window=window)
    out = decode_attention(*case.args(), sliding_window=window, num_splits=num_splits)
    check_against_golden(out, windowed_golden(case, window), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


# windows of one key, of a few, unaligned to pages and tiles, larger than every context (120 <
# the 128 positions the lookup table holds), larger than the cache; splits of a short window
# left empty (3 keys, 7 splits)
@pytest.mark.parametrize(
    "window, num_splits, page_size",
    [(1, 1, 16), (1, 4, 1), (3, 7, 16), (21, 2, None), (21, 3, 16), (50, 7, 1), (120, 3, 16), (10**9, 2, 16)],
)
def test_decode_sliding_window_matches_golden(make_kv_case, check_against_golden, window, num_splits, page_size):
    case = make_kv_case(DECODE, n_heads=4, n_kv_heads=2, head_dim=32, page_size=page_size, device=DEVICE)
    _check_window(case, check_against_golden, window, num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sliding_window_reads_only_the_window(make_kv_case, check_against_golden, num_splits):
    # every position before a sequence's window is NaN: reading one poisons the output
    window = 20
    case = make_kv_case(DECODE, head_dim=32, page_size=16, device=DEVICE)
    ref, gold = reference_output(case, sliding_window=window), windowed_golden(case, window)
    hide_before(case, [max(0, cached + new - window) for cached, new in DECODE])
    out = decode_attention(*case.args(), sliding_window=window, num_splits=num_splits)
    check_against_golden(out, gold, ref)


def test_decode_sliding_window_differs_from_causal(make_kv_case, check_against_golden):
    case = make_kv_case([(40, 1)], head_dim=32, device=DEVICE)
    windowed = _check_window(case.clone(), check_against_golden, 7, num_splits=2)
    assert not torch.allclose(windowed, decode_attention(*case.args(), num_splits=2), atol=1e-3)


def _check_softcap(case, check_against_golden, softcap, num_splits, window=None, scale=None):
    before = case.kv_blocks.clone()
    ref = reference_output(case, scale, window, softcap)
    out = decode_attention(*case.args(), scale=scale, sliding_window=window, softcap=softcap, num_splits=num_splits)
    check_against_golden(out, windowed_golden(case, window, scale, softcap), ref)
    torch.testing.assert_close(case.kv_blocks, case.expected_blocks(before), rtol=0, atol=0, equal_nan=True)
    return out


# caps that bend most scores (1) and only the largest (30), alone and under windows; one split
# and several, some left empty; paged, one-row pages and continuous caches; grouped queries
@pytest.mark.parametrize(
    "softcap, window, num_splits, page_size, n_heads, n_kv_heads",
    [(1.0, None, 1, 16, 4, 2), (30.0, None, 3, None, 8, 1), (1.0, None, 7, 1, 4, 4),
     (30.0, 21, 2, 16, 4, 2), (1.0, 3, 7, None, 6, 2), (30.0, 50, 3, 1, 8, 1)],
)
def test_decode_softcap_matches_golden(make_kv_case, check_against_golden, softcap, window, num_splits, page_size,
                                       n_heads, n_kv_heads):
    case = make_kv_case(DECODE, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=32, page_size=page_size,
                        device=DEVICE)
    _check_softcap(case, check_against_golden, softcap, num_splits, window)


def test_decode_softcap_half_precision(make_kv_case, check_against_golden):
    case = make_kv_case(DECODE, head_dim=64, dtype=torch.float16, device=DEVICE)
    _check_softcap(case, check_against_golden, 1.0, num_splits=4, scale=0.5)


@pytest.mark.parametrize("softcap", [1.0, 30.0])
def test_decode_softcap_bends_large_scores(make_kv_case, check_against_golden, softcap):
    # scale 2 puts scores around +-11: both caps move them, and with them the output
    case = make_kv_case([(40, 1), (9, 1)], head_dim=32, device=DEVICE)
    capped = _check_softcap(case.clone(), check_against_golden, softcap, num_splits=2, scale=2.0)
    assert not torch.allclose(capped, decode_attention(*case.args(), scale=2.0, num_splits=2), atol=1e-2)


def test_decode_splits_only_the_window(make_kv_case, monkeypatch):
    # with no split count given, a long context under a short window is sized by the window
    monkeypatch.setattr(decode, "multiprocessors", lambda device: 132)
    seen = []
    monkeypatch.setattr(decode, "launch_decode", lambda *args: seen.append(args[5]))
    case = make_kv_case([(4 * MIN_SPLIT_TOKENS, 1)], device=DEVICE)
    decode_attention(*case.args())
    decode_attention(*case.args(), sliding_window=MIN_SPLIT_TOKENS)
    assert seen == [5, 1]


def test_decode_rejects_a_prefill_batch_and_leaves_cache_unchanged(make_kv_case):
    case = make_kv_case([(3, 2), (4, 1)], device=DEVICE)
    before = case.kv_blocks.clone()
    with pytest.raises(CacheInputError, match=r"max_lengths\[0, 0\] = 2"):
        decode_attention(*case.args())
    with raises_naming(CacheInputError, "num_splits", f"[1, {MAX_SPLITS}]", str(MAX_SPLITS + 1)):

        decode_attention(*make_kv_case([(3, 1)], device=DEVICE).args(), num_splits=MAX_SPLITS + 1)
    assert torch.equal(case.kv_blocks, before)


def test_choose_num_splits_fills_the_device_only_for_long_contexts():
    # one long sequence on 132 multiprocessors: split until the device is full
    assert choose_num_splits(batch=1, n_kv_heads=8, max_context=32768, multiprocessors=132) == 33
    # enough sequences to fill the device already: no split
    assert choose_num_splits(batch=256, n_kv_heads=8, max_context=32768, multiprocessors=132) == 1
    # a short context is not cut below MIN_SPLIT_TOKENS positions per split
    assert choose_num_splits(batch=1, n_kv_heads=1, max_context=3 * MIN_SPLIT_TOKENS, multiprocessors=132) == 3
    # never more than MAX_SPLITS
    assert choose_num_splits(batch=1, n_kv_heads=1, max_context=1 << 20, multiprocessors=132) == MAX_SPLITS
    # a step without sequences (whatever max_lengths says) still gets a split count
    assert choose_num_splits(batch=0, n_kv_heads=8, max_context=600, multiprocessors=132) == 3


@gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 256, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_long_context_cuda(make_kv_case, check_against_golden, head_dim, page_size, dtype):
    lengths = [(32 * 1024 - 1, 1), (5000, 1), (0, 1), (255, 1)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=head_dim, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check(case, check_against_golden, num_splits=None)


@gpu
@pytest.mark.parametrize("window", [1, 100, 4096, 20000])
@pytest.mark.parametrize("page_size", [1, 16, 256, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_sliding_window_long_context_cuda(make_kv_case, check_against_golden, window, page_size, dtype):
    lengths = [(32 * 1024 - 1, 1), (5000, 1), (0, 1), (255, 1)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=128, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check_window(case, check_against_golden, window, num_splits=None)


@gpu
@pytest.mark.parametrize("softcap, window", [(1.0, None), (30.0, None), (30.0, 4096), (50.0, 100)])
@pytest.mark.parametrize("page_size", [1, 16, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_softcap_long_context_cuda(make_kv_case, check_against_golden, softcap, window, page_size, dtype):
    lengths = [(32 * 1024 - 1, 1), (5000, 1), (0, 1), (255, 1)]
    case = make_kv_case(lengths, n_heads=32, n_kv_heads=8, head_dim=128, page_size=page_size,
                        dtype=dtype, device="cuda")
    _check_softcap(case, check_against_golden, softcap, num_splits=None, window=window)
