"""The Triton kernels over a quantized cache (int8 / float8_e4m3fn K/V, float32 scales per group):
the op, flash-decoding and the prefill kernel against the float64 golden of the dequantized cache,
the bytes and scales they store against the reference's, and the caches they refuse."""

from __future__ import annotations

import pytest
import torch

from kvgraph.cache.quant import quantize
from kvgraph.errors import CacheInputError
from kvgraph.ops.plan import StepPlan
from kvgraph.ops.triton import (
    checks,
    decode_attention,
    prefill_attention,
    ragged_attention,
    store_kv,
)
from tests.naming import raises_naming
from tests.ops.quantized_cases import QuantizedCase, check
from tests.ops.triton.triton_cases import BF16, DEVICE

STORAGE = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(params=STORAGE, ids=["int8", "fp8"])
def storage(request) -> torch.dtype:
    return request.param


def test_op_matches_the_golden_of_the_dequantized_cache(storage, make_kv_case, check_against_golden,
                                                         ragged_lengths, cache_page_size):
    case = make_kv_case(ragged_lengths, page_size=cache_page_size, head_dim=32, device=DEVICE)
    check(ragged_attention, QuantizedCase(case, storage, 16), check_against_golden)


# one scale per row (fp32 queries take split bf16 dots: tile_kernel.split_dot) or two per row
@pytest.mark.parametrize("num_splits, group", [(1, 32), (3, 32), (3, 64)])
def test_decode_splits(storage, make_kv_case, check_against_golden, num_splits, group):
    case = make_kv_case([(0, 1), (5, 1), (15, 1), (96, 1), (8, 0)], head_dim=64, device=DEVICE)

    def decode(*args, **kwargs):
        return decode_attention(*args, num_splits=num_splits, **kwargs)

    check(decode, QuantizedCase(case, storage, group), check_against_golden)


# head_dim, group: two power-of-two groups; one group of a head that is no power of two (padded to
# 128); two groups of 24 in a head of 48 (padded to 64); sixteen groups of 4, the most the kernels take
@pytest.mark.parametrize("head_dim, group", [(32, 16), (80, 80), (48, 24), (64, 4)])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_gqa_and_groups(storage, make_kv_case, check_against_golden, head_dim, group, n_heads, n_kv_heads):
    case = make_kv_case([(20, 1), (0, 17), (33, 9)], n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                        device=DEVICE)
    check(ragged_attention, QuantizedCase(case, storage, group), check_against_golden)


@pytest.mark.parametrize("window, softcap", [(1, None), (5, 3.0), (40, None)])
@pytest.mark.parametrize("page_size", [1, 16, None], ids=["page1", "page16", "continuous"])
def test_sliding_window_and_softcap(storage, make_kv_case, check_against_golden, window, softcap, page_size):
    case = make_kv_case([(40, 1), (0, 33), (19, 18)], page_size=page_size, head_dim=32, device=DEVICE)
    check(prefill_attention, QuantizedCase(case, storage, 16), check_against_golden, sliding_window=window,
          softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_half_precision_queries(make_kv_case, check_against_golden, dtype):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], dtype=dtype, head_dim=32, device=DEVICE)
    check(ragged_attention, QuantizedCase(case, torch.int8, 16), check_against_golden)


def test_store_writes_the_references_bytes_and_scales(storage, make_kv_case):
    """Values that round exactly half-way and values at float8's edges, stored as the reference does."""
    case = make_kv_case([(3, 5), (0, 16)], head_dim=32, device=DEVICE)
    k = case.k.clone()
    k[0, 0, :16] = torch.arange(16) - 7.5  # scale 7.5 / QMAX: ties under int8's rounding
    k[1, 0, :16] = torch.tensor([448.0, 2.0**-9, -(2.0**-10), 0.0] * 4)  # a max, subnormals, a -0 result
    qcase = QuantizedCase(case, storage, 16)
    args = list(qcase.args())
    args[1] = k
    blocks, scales = args[3], qcase.kv_scales.clone()
    store_kv(*args[1:9], kv_scales=scales)
    ref_blocks, ref_scales = qcase.kv_blocks.clone(), qcase.kv_scales.clone()
    for b, (cached, new) in enumerate([(3, 5), (0, 16)]):
        start = int(case.input_row_offsets[b])
        for i in range(new):
            block, row = case.location(b, cached + i)
            for kv, x in ((0, k), (1, case.v)):
                q, s = quantize(x[start + i], storage, 16)
                ref_blocks[block, kv, case.layer_idx, row] = q
                ref_scales[block, kv, case.layer_idx, row] = s
    got, want = blocks.view(torch.uint8), ref_blocks.view(torch.uint8)
    differ = (got != want).nonzero().tolist()[:8]
    assert not differ, (f"bytes differ at {differ}: stored {[int(got[tuple(i)]) for i in differ]}, "
                        f"the reference's {[int(want[tuple(i)]) for i in differ]}")
    assert torch.equal(scales, ref_scales)


def test_too_many_scales_per_row_are_refused_before_writing(make_kv_case):
    qcase = QuantizedCase(make_kv_case([(3, 2)], head_dim=64, device=DEVICE), torch.int8, 2)
    args, scales = qcase.args(), qcase.kv_scales.clone()
    before = args[3].clone()
    with raises_naming(CacheInputError, "32 scales per row", "head_dim 64", "16", "at least 4"):
        ragged_attention(*args, kv_scales=scales)
    assert torch.equal(args[3], before)


def test_float8_needs_a_device_that_converts_it(monkeypatch):
    plan = StepPlan(torch.device("cuda", 0), torch.float8_e4m3fn, 2, 2, 64, 1, scale_group=64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with raises_naming(CacheInputError, "float8_e4m3fn", "(8, 9)", "(8, 0)", "int8"):
        checks._check_quantized(plan)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    checks._check_quantized(plan)
