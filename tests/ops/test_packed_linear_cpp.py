"""``kvgraph_cpu::packed_linear``: ``kvgraph::linear``'s packed float32 path with the pack kept in
C++ (what compiled CPU graphs call, and what the op's Python implementation calls), kvgraph's panel
GEMM on AVX-512 builds, oneDNN's on other CPUs than Intel's, else MKL's; each product this build and
CPU have (``KVGRAPH_PACKED_GEMM``) equal to a float64 product at every row count and shape,
repacked when the weight changes, and ``F.linear`` wherever the packed path does not apply."""

import gc

import pytest
import torch
import torch.nn.functional as F

from kvgraph.ops import cpp
from kvgraph.ops import linear as L

GEMMS = ["auto", "panels", "onednn", "mkl"]


@pytest.fixture(params=GEMMS)
def kernel(request, monkeypatch):
    """The op, its weights packed for each product in turn (``KVGRAPH_PACKED_GEMM``) that this
    build and CPU have."""
    found = cpp.packed_linear_kernel()
    if found is None:
        pytest.skip("kvgraph's C++ library does not build here, or has no packed GEMM for this CPU")
    monkeypatch.setenv("KVGRAPH_PACKED_GEMM", request.param)
    try:
        cpp.packed_linear_gemm()
    except ValueError as e:
        pytest.skip(str(e))
    return found


def call(kernel, x, w, b=None):
    return kernel(x, w, b, L.MAX_PACKED_ROWS, L.PACK_ROWS)


def test_each_cpu_gets_its_fastest_product(monkeypatch):
    """kvgraph's panels on AVX-512 builds, and on AVX2 builds on a CPU not made by Intel (MKL's
    packed GEMM is slow on them); MKL's on Intel's AVX2 CPUs; oneDNN's where no SIMD build is."""
    if cpp.packed_linear_kernel() is None:
        pytest.skip("kvgraph's C++ library does not build here, or has no packed GEMM for this CPU")
    monkeypatch.delenv("KVGRAPH_PACKED_GEMM", raising=False)
    intel = L.cpu_vendor() == "GenuineIntel"
    if cpp.capability() == "AVX512" or (cpp.capability() == "AVX2" and not intel):
        expected = "panels"
    else:
        expected = "mkl" if intel else "onednn"
    assert cpp.packed_linear_gemm() == expected


def test_an_unknown_or_missing_product_is_refused(monkeypatch):
    kernel = cpp.packed_linear_kernel()
    if kernel is None:
        pytest.skip("kvgraph's C++ library does not build here, or has no packed GEMM for this CPU")
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    monkeypatch.setenv("KVGRAPH_PACKED_GEMM", "blas")
    with torch.inference_mode(), pytest.raises(ValueError, match="KVGRAPH_PACKED_GEMM=blas is not one of auto, panels, onednn, mkl"):
        call(kernel, x, w)
    if cpp.capability() not in ("AVX512", "AVX2"):
        monkeypatch.setenv("KVGRAPH_PACKED_GEMM", "panels")
        with torch.inference_mode(), pytest.raises(ValueError, match="KVGRAPH_PACKED_GEMM=panels is not available.*AVX2 or AVX-512 build"):
            call(kernel, x, w)
    monkeypatch.delenv("KVGRAPH_PACKED_GEMM")
    with torch.inference_mode():  # the refusals cached no pack for w: it is packed now
        torch.testing.assert_close(call(kernel, x, w), F.linear(x, w))


# outputs: within a panel (16 columns with AVX2, 32 with AVX-512), a panel, one past, several panels
# rows: within a register block (12 rows with AVX-512, 6 with AVX2), a block, one past, several
# blocks, past the 16 rows from which an AVX2 build blocks x for the caches, at and past 96 rows
# (one row group, packed whole; two, packed piece by piece) and 192 (three); k: within the AVX2
# loop's 4 steps at once, past it, x packed 8 k steps at a time with a remainder, and one past two
# chunks of 256. With the panels, each of their two loop nests at every shape
# (KVGRAPH_PANEL_BLOCKED_ROWS=1 blocks x at every row count, a count past every row count at none:
# x in place, K in chunks); the other products as they are.
@pytest.mark.parametrize("n", [1, 16, 17, 32, 33, 300])
@pytest.mark.parametrize("k", [1, 7, 20, 513])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 25, 96, 97, 129, 256, 257])
@pytest.mark.parametrize("loop", ["chunked", "blocked"])
def test_equals_a_float64_product_at_every_shape(kernel, monkeypatch, capfd, n, k, rows, loop):
    if cpp.packed_linear_gemm() == "panels":
        monkeypatch.setenv("KVGRAPH_PANEL_BLOCKED_ROWS", "1" if loop == "blocked" else str(1 << 40))
    elif loop == "blocked":
        pytest.skip("the blocked loop nest is the panels'")
    g = torch.Generator().manual_seed(1000 * n + 10 * k + rows)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(1, rows, k, generator=g)
    with torch.inference_mode():
        got = call(kernel, x, w, b)
    # a pack that disagrees with F.linear at its first use falls back to F.linear, which would
    # hide a wrong kernel here; the C++ warning it prints (to stderr) fails the test
    assert "differs from F.linear" not in capfd.readouterr().err
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    want = x.double() @ w.double().t() + b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k)


def test_a_non_contiguous_input_is_multiplied_as_its_values(kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 9, generator=g).t()  # [9, 64], strided
    w = torch.randn(40, 64, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(call(kernel, x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_the_op_runs_this_kernel_from_python(kernel):
    """``kvgraph::linear``'s CPU implementation is this op (so eager and compiled graphs agree)."""
    assert L.cpp_kernel() is kernel


@pytest.mark.parametrize("rows", [1, 2, 17, L.PACK_ROWS, L.PACK_ROWS + 1, L.MAX_PACKED_ROWS])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_the_ops_python_path_bit_for_bit(kernel, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(1, rows, 96, generator=g)
    with torch.inference_mode():
        got = call(kernel, x, w, b)
        assert torch.equal(got, L.linear(x, w, b))
    assert got.shape == (1, rows, 300)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_repacks_after_an_in_place_change_of_the_weight(kernel):
    x, w = torch.randn(3, 16), torch.randn(11, 16)
    with torch.no_grad():
        first = call(kernel, x, w)
        w.mul_(2)
        torch.testing.assert_close(call(kernel, x, w), 2 * first, rtol=1e-5, atol=1e-4)
        w.copy_(torch.randn(11, 16))
        torch.testing.assert_close(call(kernel, x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_a_new_weight_where_a_dead_one_was_gets_its_own_pack(kernel):
    x = torch.randn(4, 32)
    with torch.inference_mode():
        for seed in range(20):  # freed weights: their memory and TensorImpl addresses come back
            w = torch.randn(40, 32, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(call(kernel, x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
            del w
            gc.collect()


def test_a_non_contiguous_weight_is_packed_as_its_values(kernel):
    w = torch.randn(16, 11).t()
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(call(kernel, x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [L.MAX_PACKED_ROWS + 1, 1100, 2048])
def test_without_a_row_limit_prefill_sized_inputs_are_multiplied_too(kernel, rows):
    """Past 512 rows (the limit on Intel CPUs) with no limit, as on other CPUs: the packed product,
    equal to F.linear to float32 rounding."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 512, generator=g), torch.randn(300, generator=g)
    x = torch.randn(rows, 512, generator=g)
    with torch.inference_mode():
        got = kernel(x, w, b, L.NO_ROW_LIMIT, L.PACK_ROWS)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    if cpp.packed_linear_gemm() == "panels":
        assert not torch.equal(got, F.linear(x, w, b))  # not F.linear's own product (K = 512: the sums differ)


@pytest.mark.parametrize("rows", [0, L.MAX_PACKED_ROWS + 1])
def test_empty_and_prefill_sized_inputs_run_f_linear(kernel, rows):
    x, w = torch.randn(rows, 16), torch.randn(11, 16)
    with torch.inference_mode():
        assert torch.equal(call(kernel, x, w), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_and_grad_mode_run_f_linear(kernel, dtype):
    x, w = torch.randn(3, 16, dtype=dtype), torch.randn(11, 16, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(call(kernel, x, w), F.linear(x, w))
    x32, w32 = torch.randn(3, 16, requires_grad=True), torch.randn(11, 16)
    out = call(kernel, x32, w32)  # autograd on: the plain op
    assert torch.equal(out.detach(), F.linear(x32, w32).detach())
