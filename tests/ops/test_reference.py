"""The PyTorch reference of ragged_attention, its helpers, and the float64 golden itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvgraph.cache.collection import collection_for
from kvgraph.ops.reference import (
    RaggedBatch,
    naive_attention_fp64,
    ragged_attention,
    store_kv,
    token_positions,
)


def max_err(out: torch.Tensor, golden: torch.Tensor) -> float:
    return (out.double() - golden).abs().max().item() if out.numel() else 0.0


def test_matches_golden(make_kv_case, ragged_lengths, cache_page_size, reference_tol):
    case = make_kv_case(ragged_lengths, page_size=cache_page_size)
    out = ragged_attention(*case.args())
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert max_err(out, case.golden()) <= reference_tol[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_dtypes(make_kv_case, dtype, page_size, reference_tol):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=page_size, dtype=dtype)
    out = ragged_attention(*case.args())
    assert out.dtype == dtype
    assert max_err(out, case.golden()) <= reference_tol[dtype]


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa2", "gqa8"])
def test_gqa_ratios(make_kv_case, n_heads, n_kv_heads, reference_tol):
    case = make_kv_case([(11, 1), (0, 17), (5, 6)], n_heads=n_heads, n_kv_heads=n_kv_heads)
    assert max_err(ragged_attention(*case.args()), case.golden()) <= reference_tol[torch.float32]


def test_scale_argument(make_kv_case, reference_tol):
    case = make_kv_case([(11, 3), (0, 5)])
    out = ragged_attention(*case.args(), scale=0.37)
    assert max_err(out, case.golden(scale=0.37)) <= reference_tol[torch.float32]
    assert max_err(out, case.golden()) > 1e-3  # the default scale gives a different answer


def test_stores_exactly_the_new_rows(make_kv_case, cache_page_size):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=cache_page_size)
    before = case.kv_blocks.clone()
    ragged_attention(*case.args())
    assert torch.equal(case.kv_blocks, case.expected_blocks(before))


@pytest.mark.parametrize("page_size", [4, None], ids=["paged", "continuous"])
def test_store_kv_accepts_inputs_or_collection(make_kv_case, page_size):
    case = make_kv_case([(3, 5), (9, 1)], page_size=page_size, layer_idx=0)
    expected = case.expected_blocks(case.kv_blocks)
    via_inputs = case.clone()
    store_kv(via_inputs.k, via_inputs.v, via_inputs.inputs, via_inputs.input_row_offsets, 0)
    via_collection = case.clone()
    store_kv(via_collection.k, via_collection.v, collection_for(via_collection.inputs),
             via_collection.input_row_offsets, 0)
    assert torch.equal(via_inputs.kv_blocks, expected)
    assert torch.equal(via_collection.kv_blocks, expected)


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "continuous"])
def test_never_reads_outside_the_context(make_kv_case, page_size, reference_tol):
    """NaN in every cache row that is not history: a read past a sequence's end would show."""
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], page_size=page_size, fill=float("nan"))
    out = ragged_attention(*case.args())
    assert not out.isnan().any()
    assert max_err(out, case.golden()) <= reference_tol[torch.float32]


def test_token_positions():
    cache_lengths = torch.tensor([4, 0, 7], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    batch_idx, new_idx = token_positions(cache_lengths, offsets, 5)
    assert batch_idx.tolist() == [0, 0, 2, 2, 2]
    assert new_idx.tolist() == [0, 1, 0, 1, 2]


def test_ragged_batch_pad_unpad_and_mask():
    cache_lengths = torch.tensor([2, 0], dtype=torch.int32)
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    max_lengths = torch.tensor([[3, 3]], dtype=torch.int32)
    batch = RaggedBatch.build(cache_lengths, offsets, max_lengths, 4)
    assert batch.positions.tolist() == [2, 0, 1, 2]
    assert batch.total_lengths.tolist() == [3, 3]
    x = torch.arange(4.0)[:, None]
    padded = batch.pad(x)
    assert padded[..., 0].tolist() == [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert torch.equal(batch.unpad(padded), x)
    mask = batch.mask()
    assert mask[0, 0].tolist() == [True, True, True]  # decode token at position 2 sees 0..2
    assert mask[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_golden_agrees_with_sdpa_on_plain_causal_attention():
    """The oracle itself: with no cache it is causal self-attention; a decode token sees everything."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    empty = torch.zeros(0, 4, 8, dtype=torch.float64)
    golden = naive_attention_fp64(q, k, v, [empty], [empty], [0, 9])
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(golden, sdpa.transpose(0, 1), rtol=0, atol=1e-12)

    decode = naive_attention_fp64(q[-1:], k[-1:], v[-1:], [k[:-1]], [v[:-1]], [0, 1])
    torch.testing.assert_close(decode, golden[-1:], rtol=0, atol=1e-12)


def test_golden_gqa_maps_query_head_to_kv_head_by_division():
    """Query head h reads kv head h // (Hq // Hkv): swapping kv heads moves the outputs accordingly."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    kc, vc = (torch.randn(5, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out = naive_attention_fp64(q, k, v, [kc], [vc], [0, 1], scale=1 / math.sqrt(8))
    kv_head0 = naive_attention_fp64(q[:, :2], k[:, :1], v[:, :1], [kc[:, :1]], [vc[:, :1]], [0, 1])
    torch.testing.assert_close(out[:, :2], kv_head0, rtol=0, atol=1e-12)
