"""Ragged paged flash attention (prefill and mixed batches) against the fp64 golden."""

import pytest
import torch
from triton_cases import BF16, DEVICE, gpu, reference_output

from kvgraph.kernels.triton import prefill_attention

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
