"""``kvgraph::int8_weight_linear``: ``(x @ W_int8.T) * scales + bias``, by ATen's int8 kernel for a
few rows and by a GEMM over the dequantized weight beyond."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvgraph.ops import int8_linear as Q


def case(rows: int, out: int = 40, k: int = 32, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, k, generator=g).to(dtype)
    weight = torch.randint(-127, 128, (out, k), dtype=torch.int8, generator=g)
    scales = torch.rand(out, generator=g) / 127 + 1e-3
    bias = torch.randn(out, generator=g).to(dtype)
    return x, weight, scales, bias


def exact(x, weight, scales, bias=None):
    """The product in float64 of what the int8 data stands for, rounded once to x's dtype."""
    out = x.double() @ (weight.double() * scales.double()[:, None]).T
    return (out if bias is None else out + bias.double()).to(x.dtype)


@pytest.mark.parametrize("rows", [1, Q.MATVEC_ROWS // 2, Q.MATVEC_ROWS // 2 + 1, 40, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_count_computes_the_dequantized_product(rows, dtype):
    """rows are per x [2, rows, K]: 2 * rows in all, on both sides of MATVEC_ROWS."""
    x, weight, scales, bias = case(rows, dtype=dtype)
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(Q.int8_weight_linear(x, weight, scales, bias), exact(x, weight, scales, bias), **tol)
    torch.testing.assert_close(Q.int8_weight_linear(x, weight, scales), exact(x, weight, scales), **tol)


@pytest.fixture
def without_fused(monkeypatch):
    """As on a CPU where the fused kernel does not run."""
    monkeypatch.setitem(Q._fused_state, "kernel", None)


needs_fused = pytest.mark.skipif(Q.fused_kernel() is None, reason="needs the fused kernel (AVX-512, C++ library)")


@needs_fused
@pytest.mark.parametrize("rows", [Q.FUSED_MIN_ROWS, 17, Q.FUSED_MAX_ROWS])
@pytest.mark.parametrize("out", [64, 130, 7])
def test_the_fused_kernel_computes_the_dequantized_product(rows, out):
    g = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    weight = torch.randint(-127, 128, (out, 96), dtype=torch.int8, generator=g)
    scales, bias = torch.rand(out, generator=g) / 127 + 1e-3, torch.randn(out, generator=g).bfloat16()
    assert Q.kernel_for(rows, torch.bfloat16, 96) == "fused"
    for b in (bias, None):
        torch.testing.assert_close(Q.int8_weight_linear(x, weight, scales, b), exact(x, weight, scales, b),
                                   rtol=2e-2, atol=5e-2)


@needs_fused
def test_the_fused_kernel_names_a_wrong_argument():
    kernel = Q.fused_kernel()
    x, weight, scales = torch.randn(9, 32).bfloat16(), torch.zeros(70, 32, dtype=torch.int8), torch.ones(70)
    with pytest.raises(RuntimeError, match="1..64 rows, got 65"):
        kernel(torch.randn(65, 32).bfloat16(), weight, scales, None)
    with pytest.raises(RuntimeError, match="K must be even"):
        kernel(torch.randn(9, 31).bfloat16(), torch.zeros(70, 31, dtype=torch.int8), scales, None)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32 of 70"):
        kernel(x, weight, scales.bfloat16(), None)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bfloat16"):
        kernel(x.float(), weight, scales, None)


needs_matvec = pytest.mark.skipif(Q.matvec_kernel() is None, reason="needs the matvec kernel (AVX-512 VNNI, C++ library)")


@needs_matvec
@pytest.mark.parametrize("k", [32, 100, 192, 200, 1408])  # 64-weight steps: a tail only, 1 + tail, 3, 3 + tail, 22
@pytest.mark.parametrize("out", [1, 5, 70, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_matvec_kernel_computes_the_dequantized_product(k, out, dtype):
    """One row, any K (not only multiples of 64) and any number of weight rows (not only of 4):
    float32 rows to float32 rounding, since the row is split exactly into its int8 parts."""
    g = torch.Generator().manual_seed(k + out)
    x = torch.randn(1, k, generator=g).to(dtype)
    weight = torch.randint(-127, 128, (out, k), dtype=torch.int8, generator=g)
    scales, bias = torch.rand(out, generator=g) / 127 + 1e-3, torch.randn(out, generator=g).to(dtype)
    assert Q.kernel_for(1, dtype, k) == "matvec"
    tol = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-5}
    for b in (bias, None):
        torch.testing.assert_close(Q.int8_weight_linear(x, weight, scales, b), exact(x, weight, scales, b), **tol)
    zeros = Q.int8_weight_linear(torch.zeros(1, k, dtype=dtype), weight, scales, bias)
    torch.testing.assert_close(zeros, bias[None], rtol=0, atol=0)


@needs_matvec
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_matvec_kernel_carries_a_nan_or_an_infinity(bad):
    """A non-finite activation cannot be split into int8 parts: the product still carries it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 100, generator=g)
    x[0, 37] = bad
    weight = torch.randint(-127, 128, (9, 100), dtype=torch.int8, generator=g)
    scales = torch.rand(9, generator=g) / 127 + 1e-3
    got = Q.int8_weight_linear(x, weight, scales)
    want = exact(x, weight, scales)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=1e-5)
    assert not got.isfinite().any()


@needs_matvec
def test_the_matvec_kernel_reuses_a_split_only_for_the_same_bytes():
    """A call whose row has the previous call's bytes reuses its split (q, k and v read one x): the
    same row again, a row changed in place at the same address, a NaN put in and taken out, and
    float32 bytes after bfloat16 ones of the same size all give the dequantized product."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randint(-127, 128, (n, 512), dtype=torch.int8, generator=g) for n in (64, 32)]
    scales = [torch.rand(n, generator=g) / 127 + 1e-3 for n in (64, 32)]
    tol = {"rtol": 1e-6, "atol": 1e-5}

    def check(x, i=0):
        got = Q.int8_weight_linear(x, weights[i], scales[i])
        torch.testing.assert_close(got, exact(x, weights[i], scales[i]), equal_nan=True, **tol)
        return got

    x = torch.randn(1, 512, generator=g)
    first = check(x)
    check(x, 1)  # the same x, another weight: the split reused
    torch.testing.assert_close(check(x.clone()), first, rtol=0, atol=0)  # same bytes, another tensor
    x[0, 100] += 1.0  # changed in place: same address, new bytes
    check(x)
    x[0, 7] = float("nan")
    assert check(x).isnan().all()
    x[0, 7] = 0.5
    assert check(x).isfinite().all()
    half = torch.randn(1, 1024, generator=g).to(torch.bfloat16)
    wide = half.view(torch.float32)  # the bf16 row's 2048 bytes read as 512 float32 values
    wide = torch.where(wide.isfinite(), wide, torch.zeros_like(wide)).clamp(-1e3, 1e3)
    Q.int8_weight_linear(wide.view(torch.bfloat16), torch.randint(-127, 128, (8, 1024), dtype=torch.int8),
                         torch.rand(8) / 127 + 1e-3)
    check(wide)  # float32 bytes equal to the last bfloat16 call's: split again
    tol = {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(Q.int8_weight_linear(half, weights[0].repeat(1, 2), scales[0]),
                               exact(half, weights[0].repeat(1, 2), scales[0]), **tol)


@needs_matvec
def test_the_matvec_kernel_names_a_wrong_argument():
    kernel = Q.matvec_kernel()
    weight, scales = torch.zeros(70, 32, dtype=torch.int8), torch.ones(70)
    with pytest.raises(RuntimeError, match="x must be one row"):
        kernel(torch.randn(2, 32), weight, scales, None)
    with pytest.raises(RuntimeError, match="x's K = 31 but the weight's is 32"):
        kernel(torch.randn(1, 31), weight, scales, None)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32 of 70"):
        kernel(torch.randn(1, 32), weight, scales.bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 of 70"):
        kernel(torch.randn(1, 32), weight, scales, torch.ones(69))


def test_the_kernel_follows_rows_dtype_and_k():
    fused = Q.fused_kernel() is not None
    mid = "fused" if fused else "aten"
    one = "matvec" if Q.matvec_kernel() is not None else "aten"
    assert Q.kernel_for(1, torch.bfloat16, 32) == one
    assert Q.kernel_for(1, torch.float32, 31) == one
    assert Q.kernel_for(1, torch.float16, 32) == "aten"
    assert Q.kernel_for(2, torch.bfloat16, 32) == "aten"
    assert Q.kernel_for(Q.FUSED_MIN_ROWS - 1, torch.bfloat16, 32) == "aten"
    assert Q.kernel_for(Q.FUSED_MIN_ROWS, torch.bfloat16, 32) == mid
    assert Q.kernel_for(Q.FUSED_MAX_ROWS, torch.bfloat16, 32) == ("fused" if fused else "dequantize")
    assert Q.kernel_for(Q.FUSED_MAX_ROWS + 1, torch.bfloat16, 32) == "dequantize"
    assert Q.kernel_for(Q.FUSED_MIN_ROWS, torch.bfloat16, 31) == "aten"  # odd K: no VNNI pairs
    assert Q.kernel_for(Q.MATVEC_ROWS + 1, torch.float32, 32) == "dequantize"


def test_without_the_fused_kernel_the_row_count_picks_aten_or_the_gemm(monkeypatch, without_fused):
    used = []
    real = torch.ops.aten._weight_int8pack_mm

    class Spy:
        def __call__(self, *args):
            used.append("aten")
            return real(*args)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", Spy())
    for rows in (Q.MATVEC_ROWS, Q.MATVEC_ROWS + 1):
        x, weight, scales, _ = case(1)
        Q.int8_weight_linear(torch.randn(rows, 32).bfloat16(), weight, scales)
    assert used == ["aten"]  # MATVEC_ROWS rows: ATen's kernel; one more: the GEMM


def test_the_two_kernels_agree_across_the_threshold():
    """Rows on both sides of the threshold see the same weights: the same values to bf16 rounding."""
    x, weight, scales, _ = case(Q.MATVEC_ROWS + 1)
    rows = x.reshape(-1, x.shape[-1])
    below = torch.cat([Q.int8_weight_linear(r[None], weight, scales) for r in rows])
    above = Q.int8_weight_linear(rows, weight, scales)
    torch.testing.assert_close(below, above, rtol=2e-2, atol=2e-2)


def test_wrong_arguments_are_named():
    x, weight, scales, bias = case(2)
    with pytest.raises(ValueError, match=r"weight must be a 2-D int8 tensor, got torch\.float32"):
        Q.int8_weight_linear(x, weight.float(), scales)
    with pytest.raises(ValueError, match=r"last dim 31 is not the weight's K = 32"):
        Q.int8_weight_linear(x[..., :31], weight, scales)
    with pytest.raises(ValueError, match=r"scales must have shape \(40,\), got \(40, 1\)"):
        Q.int8_weight_linear(x, weight, scales[:, None])
    with pytest.raises(ValueError, match=r"bias must have shape \(40,\), got \(39,\)"):
        Q.int8_weight_linear(x, weight, scales, bias[:39])


def test_fake_impl_gives_the_shape():
    with FakeTensorMode():
        out = Q.int8_weight_linear(torch.empty(1, 5, 32, dtype=torch.bfloat16), torch.empty(40, 32, dtype=torch.int8),
                                   torch.empty(40))
    assert out.shape == (1, 5, 40) and out.dtype == torch.bfloat16


needs_library = pytest.mark.skipif(Q.cpu_routes() is None, reason="needs kvgraph's C++ library")


@needs_library
@pytest.mark.parametrize("rows", [0, 1, 2, Q.FUSED_MIN_ROWS - 1, Q.FUSED_MIN_ROWS, 17, Q.MATVEC_ROWS, Q.MATVEC_ROWS + 1,
                                  Q.FUSED_MAX_ROWS, Q.FUSED_MAX_ROWS + 1, 150])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpp_routing_is_the_python_op_bit_for_bit(rows, dtype):
    """kvgraph_cpu::int8_weight_linear (what quantized layers call on the CPU) picks the Python op's
    kernel for every row count: the same values, not only close ones."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=g).to(dtype)
    weight = torch.randint(-127, 128, (70, 96), dtype=torch.int8, generator=g)
    scales, bias = torch.rand(70, generator=g) / 127 + 1e-3, torch.randn(70, generator=g).to(dtype)
    routes = Q.cpu_routes()
    for b in (bias, None):
        got = Q.int8_weight_linear(x, weight, scales, b, routes)
        assert got.shape == (1, rows, 70) and got.dtype == dtype
        assert torch.equal(got, torch.ops.kvgraph.int8_weight_linear(x, weight, scales, b))


def test_routes_follow_the_library_and_the_fused_kernel(monkeypatch, without_fused):
    if Q.cpp.int8_kernel() is not None:
        vnni = Q.VNNI_ROWS if Q.matvec_kernel() is not None else 0
        assert Q.cpu_routes() == (1, 0, Q.MATVEC_ROWS, vnni)  # no fused kernel: an empty fused range
        monkeypatch.setitem(Q._fused_state, "matvec", None)
        assert Q.cpu_routes() == (1, 0, Q.MATVEC_ROWS, 0)  # no matvec kernel: no rows for it
    monkeypatch.setattr(Q.cpp, "int8_kernel", lambda: None)
    assert Q.cpu_routes() is None


@needs_library
def test_which_op_a_layer_calls(monkeypatch):
    x, weight, scales, _ = case(3)
    for routes, name in ((Q.cpu_routes(), "kvgraph_cpu::int8_weight_linear"), (None, "kvgraph::int8_weight_linear")):
        with torch.profiler.profile() as prof:
            Q.int8_weight_linear(x, weight, scales, None, routes)
        assert name in {e.name for e in prof.events()}


@needs_library
def test_the_cpp_routing_names_a_wrong_argument():
    x, weight, scales, bias = case(2)
    routes = Q.cpu_routes()
    with pytest.raises(RuntimeError, match=r"last dim 31 is not the weight's K = 32"):
        Q.int8_weight_linear(x[..., :31], weight, scales, None, routes)
    with pytest.raises(RuntimeError, match=r"scales must have shape \(40,\), got \[40, 1\]"):
        Q.int8_weight_linear(x, weight, scales[:, None], None, routes)
    with pytest.raises(RuntimeError, match=r"weight must be a 2-D int8 tensor, got Float"):
        Q.int8_weight_linear(x, weight.float(), scales, None, routes)
    with FakeTensorMode():
        out = Q.int8_weight_linear(torch.empty(1, 5, 32, dtype=torch.bfloat16), torch.empty(40, 32, dtype=torch.int8),
                                   torch.empty(40), None, (9, 64, 48, 1))
    assert out.shape == (1, 5, 40) and out.dtype == torch.bfloat16
