"""The quantized cache: the quantization round trip, its params and their errors, the scales as a
typed input of both managers, memory sizing, copy-on-write of scales, and the collection views."""

from __future__ import annotations

import pytest
import torch

from kvgraph import (
    InvalidParamsError,
    KVCacheParams,
    KVCacheQuantizationConfig,
    KVRequest,
    PagedKVCacheManager,
    load_kv_manager,
)
from kvgraph.cache.collection import collection_for
from kvgraph.cache.quant import QMAX, dequantize, quantize, scales_shape_problem
from kvgraph.cache.symbols import kv_placeholders
from tests.naming import raises_naming

STORAGE = [torch.int8, torch.float8_e4m3fn]


def quantized(strategy: str = "paged", dtype: torch.dtype = torch.int8, granularity: int = 128, head_dim: int = 64,
              **kw) -> KVCacheParams:
    return KVCacheParams(dtype, n_kv_heads=2, head_dim=head_dim, num_layers=3, page_size=4 if strategy == "paged"
                         else None, cache_strategy=strategy,
                         kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=granularity), **kw)


# -- the round trip --

@pytest.mark.parametrize("group", [1, 8, 64])
def test_int8_round_trip_is_within_half_a_step_of_each_group(group):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    q, scales = quantize(x, torch.int8, group)
    assert q.dtype == torch.int8 and scales.shape == (50, 3, 64 // group)
    assert q.abs().max() <= 127
    err = (dequantize(q, scales) - x).unflatten(-1, (-1, group)).abs()
    assert (err <= scales[..., None] * (0.5 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("group", [8, 64])
def test_fp8_round_trip_keeps_three_mantissa_bits(group):
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    q, scales = quantize(x, torch.float8_e4m3fn, group)
    back = dequantize(q, scales).unflatten(-1, (-1, group))
    xg = x.unflatten(-1, (-1, group))
    # half an ulp of a 3-bit mantissa, or of the subnormal spacing (2^-9 of the scale) near zero
    bound = torch.maximum(xg.abs() * 2.0**-4, scales[..., None] * 2.0**-10) * (1 + 1e-5)
    assert ((back - xg).abs() <= bound).all()


@pytest.mark.parametrize("dtype", STORAGE)
def test_a_group_of_zeros_stores_zeros_with_scale_zero(dtype):
    x = torch.zeros(2, 16)
    x[1, 8:] = torch.linspace(-1, 1, 8)
    q, scales = quantize(x, dtype, 8)
    assert scales.tolist() == [[0.0, 0.0], [0.0, pytest.approx(1 / QMAX[dtype])]]
    back = dequantize(q, scales)
    assert torch.equal(back[0], torch.zeros(16)) and torch.equal(back[1, :8], torch.zeros(8))
    assert not back.isnan().any()


@pytest.mark.parametrize("dtype", STORAGE)
def test_the_largest_magnitude_of_a_group_is_exact(dtype):
    x = torch.randn(20, 32)
    back = dequantize(*quantize(x, dtype, 32))
    i = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, i), x.gather(-1, i), rtol=1e-6, atol=0)


# -- params --

def test_params_follow_max():
    p = quantized(granularity=128, head_dim=64)
    assert p.quantized and p.dtype == torch.int8
    assert p.kvcache_quant_config == KVCacheQuantizationConfig(scale_dtype=torch.float32, quantization_granularity=128)
    assert p.scale_group == 64 and p.scales_per_head == 1  # the granularity is clamped to head_dim
    assert quantized(granularity=16).scales_per_head == 4
    plain = KVCacheParams(torch.float32, 2, 64, 3)
    assert not plain.quantized and plain.scale_group is None and plain.scales_per_head == 0


def test_bytes_count_the_scales():
    p = quantized(granularity=16)
    assert p.bytes_per_token == 2 * 3 * 2 * (64 * 1 + 4 * 4)
    blocks = torch.empty(1, 2, 3, 4, 2, 64, dtype=torch.int8)
    scales = torch.empty(1, 2, 3, 4, 2, 4)
    assert p.page_bytes == blocks.nbytes + scales.nbytes


@pytest.mark.parametrize("kw, fragments", [
    (dict(granularity=48), ("quantization_granularity=48", "head_dim=64")),
    (dict(granularity=0), ("quantization_granularity", "positive int", "0")),
    (dict(dtype=torch.float16), ("8-bit storage dtype", "torch.float16")),
])
def test_bad_quantization_params_are_refused(kw, fragments):
    with raises_naming(InvalidParamsError, *fragments):
        quantized(**kw)


def test_int8_without_a_config_is_refused():
    with raises_naming(InvalidParamsError, "dtype torch.int8", "kvcache_quant_config"):
        KVCacheParams(torch.int8, 2, 64, 3)


def test_an_unsupported_scale_dtype_is_refused():
    with raises_naming(InvalidParamsError, "scale_dtype torch.float16", "torch.float32"):
        KVCacheQuantizationConfig(scale_dtype=torch.float16)


# -- managers --

@pytest.mark.parametrize("strategy", ["paged", "continuous"])
def test_scales_are_a_typed_input_of_the_manager(strategy):
    p = quantized(strategy, granularity=16)
    m = load_kv_manager(p, max_batch_size=2, max_seq_len=8)
    (symbols,) = m.input_symbols()
    assert symbols.names() == ("kv_blocks", "cache_lengths", "lookup_table", "max_lengths", "kv_scales")
    assert m.num_kv_inputs() == 5
    assert kv_placeholders(symbols)[-2:] == ("kv_scales", "input_row_offsets")
    scales_type = symbols.kv_scales
    assert scales_type.dtype == torch.float32 and scales_type.shape[:-1] == symbols.kv_blocks.shape[:-1]
    assert scales_type.shape[-1] == 4
    (seq,) = m.claim(1)
    (x,) = m.fetch([KVRequest(seq, [1, 2, 3])])
    assert x.blocks is m.blocks and x.kv_scales is m.kv_scales
    assert x.blocks.dtype == torch.int8 and x.kv_scales.shape == (*x.blocks.shape[:-1], 4)
    assert list(x) == [x.blocks, x.cache_lengths, x.lookup_table, x.max_lengths, x.kv_scales]
    for (name, t), tensor in zip(symbols.items(), x, strict=True):
        t.check(tensor, name)
    assert "kv_scales=float32" in repr(x)


def test_an_unquantized_manager_has_no_scales():
    m = load_kv_manager(KVCacheParams(torch.float32, 2, 64, 3, page_size=4), 2, 8)
    (x,) = m.fetch([KVRequest(m.claim(1)[0], [1])])
    assert m.kv_scales is None and x.kv_scales is None and len(list(x)) == 4
    assert m.input_symbols()[0].names() == ("kv_blocks", "cache_lengths", "lookup_table", "max_lengths")


def test_multistep_inputs_keep_the_scales():
    m = load_kv_manager(quantized(), 2, 16)
    (x,) = m.fetch([KVRequest(m.claim(1)[0], [1, 2])], num_steps=3)
    (nxt,) = m.increment_cache_lengths([x], torch.tensor([0, 2], dtype=torch.int32))
    assert nxt.kv_scales is m.kv_scales and nxt.cache_lengths.tolist() == [2]


def test_the_pool_holds_about_four_times_the_fp32_tokens_in_the_same_memory():
    budget = 1 << 20
    fp32 = KVCacheParams(torch.float32, n_kv_heads=2, head_dim=64, num_layers=3, page_size=4)
    int8 = quantized()
    pages = {p.dtype: PagedKVCacheManager(p, 4, 64, cache_memory=budget).total_pages for p in (fp32, int8)}
    assert pages[torch.int8] * int8.page_bytes <= budget
    assert 3.7 < pages[torch.int8] / pages[torch.float32] < 4.0
    sizes = [PagedKVCacheManager.estimated_memory_size(p, 1000, 64, 3, budget) for p in (fp32, int8)]
    assert sizes == [pages[torch.float32] * fp32.page_bytes, pages[torch.int8] * int8.page_bytes]
    m = PagedKVCacheManager(int8, 4, 64, cache_memory=budget)
    assert m.blocks.nbytes + m.kv_scales.nbytes == pages[torch.int8] * int8.page_bytes
    batch = [PagedKVCacheManager.infer_optimal_batch_size(p, 64, 3, budget) for p in (fp32, int8)]
    assert batch[1] >= 3 * batch[0]


def test_copy_on_write_copies_the_scales_with_the_rows():
    p = quantized(granularity=16, enable_prefix_caching=True)
    m = PagedKVCacheManager(p, 2, 16, num_pages=8)
    a, b = m.claim(2)
    prompt = list(range(1, 9))  # exactly 2 full pages of 4
    (x,) = m.fetch([KVRequest(a, prompt)])
    m.kv_scales[m.pages_of(a)[1]].uniform_(1, 2)  # what a step would have written
    m.blocks[m.pages_of(a)[1]].random_(-127, 127)
    m.step([KVRequest(a, prompt)])
    req = KVRequest(b, prompt)
    m.fetch([req])
    shared, own = m.pages_of(a)[1], m.pages_of(b)[1]
    assert req.cached_tokens == 7 and own != shared
    assert torch.equal(m.kv_scales[own, :, :, :3], m.kv_scales[shared, :, :, :3])
    assert torch.equal(m.blocks[own, :, :, :3], m.blocks[shared, :, :, :3])
    assert (m.kv_scales[own, :, :, :3] >= 1).all()


# -- views --

@pytest.mark.parametrize("strategy", ["paged", "continuous"])
@pytest.mark.parametrize("dtype", STORAGE)
def test_views_store_quantized_and_load_dequantized(strategy, dtype):
    m = load_kv_manager(quantized(strategy, dtype=dtype, granularity=16), 2, 8)
    a, b = m.claim(2)
    (x,) = m.fetch([KVRequest(a, [1, 2, 3]), KVRequest(b, [4, 5])])
    keys = collection_for(x).get_key_cache(1)
    values = torch.randn(5, 2, 64)
    batch_idx, tok_idx = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])
    keys.store(batch_idx, tok_idx, values)
    held = dequantize(*quantize(values, dtype, 16))
    assert torch.equal(keys.load(batch_idx, tok_idx), held)
    padded = keys.load_padded(torch.tensor([3, 2]), 4)
    assert padded.dtype == torch.float32
    assert torch.equal(padded[0, :3], held[:3]) and torch.equal(padded[1, :2], held[3:])
    assert not padded[0, 3:].any() and not padded[1, 2:].any()
    assert m.kv_scales.count_nonzero() > 0


def test_one_rule_tells_a_wrong_scales_shape():
    """The collection, the runtime's binding and the op's plan all raise with this text."""
    blocks = (5, 2, 3, 16, 4, 64)
    assert scales_shape_problem(blocks, (5, 2, 3, 16, 4, 1)) is None
    assert scales_shape_problem(blocks, (5, 2, 3, 16, 4, 8)) is None
    assert "must be kv_blocks' (5, 2, 3, 16, 4)" in scales_shape_problem(blocks, (5, 2, 3, 16, 4))
    assert "must be kv_blocks' (5, 2, 3, 16, 4)" in scales_shape_problem(blocks, (5, 2, 3, 8, 4, 1))
    assert scales_shape_problem(blocks, (5, 2, 3, 16, 4, 3)) == (
        "kv_scales has 3 scales per row, which does not divide head_dim 64")
    assert "does not divide" in scales_shape_problem(blocks, (5, 2, 3, 16, 4, 0))
    symbolic = object()  # a size not known while tracing is not compared
    assert scales_shape_problem((symbolic, 2, 3, 16, 4, 64), (7, 2, 3, 16, 4, 1)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_cuda_quantizes_to_the_same_bytes_and_scales_as_the_cpu(dtype):
    """The scales are ``max|x| / QMAX`` divided exactly on either device (CUDA's ``tensor / number``
    multiplies by the reciprocal instead: one bit off in 4 % of int8 groups and half the float8
    ones of random data)."""
    x = torch.randn(4096, 64)
    q, scales = quantize(x, dtype, 16)
    q_cuda, scales_cuda = quantize(x.cuda(), dtype, 16)
    assert torch.equal(scales_cuda.cpu(), scales)
    assert torch.equal(q_cuda.cpu().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scales, x.unflatten(-1, (4, 16)).abs().amax(-1).double().div(QMAX[dtype]).float())
