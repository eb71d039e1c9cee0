"""The KV store kernel writes exactly the new tokens' rows of one layer, K and V, and nothing else."""

import pytest
import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops.triton import store_kv
from tests.naming import raises_naming
from tests.ops.triton.triton_cases import BF16, DEVICE, gpu

# new prompt, decode step, prompt crossing pages, no new token, page filled exactly
LENGTHS = [(0, 17), (5, 1), (30, 3), (16, 0), (9, 7)]


def _store(case):
    store_kv(case.k, case.v, case.kv_blocks, case.cache_lengths, case.lookup_table,
             case.input_row_offsets, case.max_lengths, case.layer_idx)


def test_store_writes_exactly_the_new_rows(make_kv_case, cache_page_size):
    case = make_kv_case(LENGTHS, page_size=cache_page_size, head_dim=80, device=DEVICE)
    before = case.kv_blocks.clone()
    _store(case)
    assert torch.equal(case.kv_blocks.cpu(), case.expected_blocks(before).cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_half_precision_keeps_bits(make_kv_case, dtype):
    case = make_kv_case([(3, 97)], n_kv_heads=1, head_dim=96, dtype=dtype, layer_idx=0, device=DEVICE)
    before = case.kv_blocks.clone()
    _store(case)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


def test_store_skips_unused_lookup_entries(make_kv_case):
    # a position whose page entry holds the unused marker must not write past the cache
    case = make_kv_case([(14, 2)], page_size=16, device=DEVICE)
    case.lookup_table[0, 0] = case.kv_blocks.shape[0]
    before = case.kv_blocks.clone()
    _store(case)
    assert torch.equal(case.kv_blocks, before)


def test_store_rejects_mismatched_heads_and_leaves_cache_unchanged(make_kv_case):
    case = make_kv_case([(2, 3)], device=DEVICE)
    before = case.kv_blocks.clone()
    with raises_naming(CacheInputError, "kv_blocks [.., Hkv, D] = (2, 16)", "k/v heads 4"):

        store_kv(case.q, case.q, case.kv_blocks, case.cache_lengths, case.lookup_table,
                 case.input_row_offsets, case.max_lengths, case.layer_idx)
    assert torch.equal(case.kv_blocks, before)


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 256, None])
@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_store_large_batch_cuda(make_kv_case, page_size, dtype):
    lengths = [(i * 37 % 1000, (i * 53) % 700 + 1) for i in range(24)]
    case = make_kv_case(lengths, n_heads=8, n_kv_heads=8, head_dim=128, page_size=page_size,
                        dtype=dtype, device="cuda")
    before = case.kv_blocks.clone()
    _store(case)
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))
