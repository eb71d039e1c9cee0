"""The op over a quantized cache (int8 / float8_e4m3fn K/V, float32 scales per group): the C++ kernel
and the SDPA path against the float64 golden of the dequantized cache, the bytes they store against
the reference's, and the arguments they refuse."""

from __future__ import annotations

import pytest
import torch

from kvgraph.errors import CacheInputError
from kvgraph.ops import attention, cpp, cpu, reference
from tests.naming import raises_naming
from tests.ops.quantized_cases import QuantizedCase, check

IMPLS = {"cpp": cpp.ragged_attention, "sdpa": cpu.ragged_attention}
STORAGE = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(params=list(IMPLS))
def impl(request):
    """One CPU implementation of the op (same arguments)."""
    return IMPLS[request.param]


@pytest.fixture(params=STORAGE, ids=["int8", "fp8"])
def storage(request) -> torch.dtype:
    return request.param


def test_matches_the_golden_of_the_dequantized_cache(impl, storage, make_kv_case, check_against_golden,
                                                     ragged_lengths, cache_page_size):
    case = make_kv_case(ragged_lengths, page_size=cache_page_size, head_dim=32)
    check(impl, QuantizedCase(case, storage, 16), check_against_golden)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("group", [8, 32])
def test_gqa_and_groups(impl, storage, make_kv_case, check_against_golden, n_heads, n_kv_heads, group):
    case = make_kv_case([(20, 1), (0, 17), (33, 9)], n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=32)
    check(impl, QuantizedCase(case, storage, group), check_against_golden)


@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("page_size", [1, 16, None], ids=["page1", "page16", "continuous"])
def test_sliding_window_and_softcap(impl, storage, make_kv_case, check_against_golden, window, softcap, page_size):
    case = make_kv_case([(40, 1), (0, 33), (19, 18)], page_size=page_size, head_dim=32)
    check(impl, QuantizedCase(case, storage, 16), check_against_golden, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_model_dtypes(impl, make_kv_case, check_against_golden, dtype):
    case = make_kv_case([(20, 1), (0, 17), (7, 9)], dtype=dtype, head_dim=32)
    check(impl, QuantizedCase(case, torch.int8, 16), check_against_golden)


def test_cpp_kernel_reads_the_cache_of_a_long_decode(storage, make_kv_case, check_against_golden):
    case = make_kv_case([(300, 1), (129, 1), (64, 1)], page_size=16, head_dim=64, n_heads=8, n_kv_heads=2)
    check(cpp.ragged_attention, QuantizedCase(case, storage, 64), check_against_golden)


def test_a_quantized_cache_is_close_to_the_float_one(make_kv_case):
    """What quantization costs: the op over the int8 cache stays near the op over the float32 cache."""
    case = make_kv_case([(64, 1), (0, 17)], head_dim=64)
    full = reference.ragged_attention(*case.clone().args())
    out, _, _ = QuantizedCase(case, torch.int8, 64).run(cpp.ragged_attention)
    assert 0 < (out - full).abs().max().item() < 0.05


def test_int8_blocks_without_scales_are_refused(make_kv_case):
    qcase = QuantizedCase(make_kv_case([(3, 2)]), torch.int8, 16)
    with raises_naming(CacheInputError, "kv_blocks dtype torch.int8", "kv_scales"):
        torch.ops.kvgraph.ragged_attention(*qcase.args())


def test_scales_with_float_blocks_are_refused(make_kv_case):
    case = make_kv_case([(3, 2)])
    scales = torch.ones(*case.kv_blocks.shape[:5], 1)
    with raises_naming(CacheInputError, "kv_scales", "8-bit", "torch.float32"):
        torch.ops.kvgraph.ragged_attention(*case.args(), kv_scales=scales)


@pytest.mark.parametrize("last, dtype, fragments", [
    (3, torch.float32, ("3 scales per row", "head_dim 16")),
    (2, torch.float16, ("kv_scales dtype torch.float16", "torch.float32")),
])
def test_scales_that_do_not_fit_are_refused_before_writing(make_kv_case, last, dtype, fragments):
    qcase = QuantizedCase(make_kv_case([(3, 2)]), torch.int8, 16)
    args = qcase.args()
    before = args[3].clone()
    scales = torch.ones(*args[3].shape[:5], last, dtype=dtype)
    with raises_naming(CacheInputError, *fragments):
        torch.ops.kvgraph.ragged_attention(*args, kv_scales=scales)
    assert torch.equal(args[3], before)


def test_scales_of_another_shape_are_refused(make_kv_case):
    qcase = QuantizedCase(make_kv_case([(3, 2)]), torch.int8, 16)
    scales = qcase.kv_scales[:-1].clone()
    with raises_naming(CacheInputError, "kv_scales shape", str(tuple(scales.shape))):
        torch.ops.kvgraph.ragged_attention(*qcase.args(), kv_scales=scales)


def test_a_device_without_a_quantized_kernel_is_refused():
    with raises_naming(CacheInputError, "meta", "['cpu', 'cuda']"):
        attention.check_quantized_device(torch.device("meta"))
    attention.check_quantized_device(torch.device("cpu"))
    attention.check_quantized_device(torch.device("cuda"))


def test_the_op_under_torch_compile_writes_blocks_and_scales(make_kv_case):
    qcase = QuantizedCase(make_kv_case([(20, 1), (0, 17)]), torch.int8, 16)
    expected, ref_blocks, ref_scales = qcase.run(reference.ragged_attention)

    def step(*args, kv_scales):
        return torch.ops.kvgraph.ragged_attention(*args, kv_scales=kv_scales) * 2

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    args, scales = qcase.args(), qcase.kv_scales.clone()
    out = compiled(*args, kv_scales=scales)
    torch.testing.assert_close(out, expected * 2)
    assert torch.equal(args[3], ref_blocks) and torch.equal(scales, ref_scales)



INT8_PATHS = ["auto", "avx2", "tiles"]


@pytest.mark.parametrize("path", INT8_PATHS)
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, group", [
    (8, 2, 64, 64),  # one scale per row, 4 rows per item (kv_quant's shape)
    (6, 1, 32, 8),  # a scale per 8 elements, 6 rows: a block of 4 and one of 2
    (4, 4, 48, 16),  # one row per item
    (3, 1, 24, 8),  # 3 rows; D = 16 + 8: a chunk pair, then a single chunk
    (4, 2, 20, 4),  # D and group not multiples of 8: AVX2 cannot read it, the tiles do
])
@pytest.mark.parametrize("page_size", [1, 16, None], ids=["page1", "page16", "continuous"])
def test_every_int8_decode_path_matches_the_golden(monkeypatch, make_kv_case, check_against_golden, path,
                                                   n_heads, n_kv_heads, head_dim, group, page_size):
    """KVGRAPH_INT8_DECODE's paths on this CPU (a path it lacks falls back): runs of keys whole,
    cut short by a page, and a tail under 8 keys."""
    monkeypatch.setenv("KVGRAPH_INT8_DECODE", path)
    case = make_kv_case([(300, 1), (21, 1), (0, 1), (16, 1)], page_size=page_size, n_heads=n_heads,
                        n_kv_heads=n_kv_heads, head_dim=head_dim)
    check(cpp.ragged_attention, QuantizedCase(case, torch.int8, group), check_against_golden)


def test_an_unknown_int8_decode_path_is_refused(monkeypatch, make_kv_case):
    monkeypatch.setenv("KVGRAPH_INT8_DECODE", "fastest")
    qcase = QuantizedCase(make_kv_case([(5, 1)], head_dim=32), torch.int8, 32)
    args, scales = qcase.args(), qcase.kv_scales.clone()
    with pytest.raises(ValueError, match="KVGRAPH_INT8_DECODE=fastest is not one of auto, avx2, tiles"):
        cpp.ragged_attention(*args, kv_scales=scales)
    assert torch.equal(args[3], qcase.kv_blocks) and torch.equal(scales, qcase.kv_scales)  # nothing stored
