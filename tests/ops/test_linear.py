"""``kvgraph::linear``: F.linear with a packed weight on the CPU, repacked when the weight changes.

With kvgraph's C++ library the op calls ``kvgraph_cpu::packed_linear`` (``test_packed_linear_cpp.py``);
without it, its Python path packs for MKL's packed GEMM, else oneDNN (``python_linear``), which the
tests below run with the library hidden unless they say otherwise."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kvgraph.ops import linear as L

pytestmark = pytest.mark.skipif(not L._CAN_PACK, reason="needs MKL or oneDNN")
needs_mkl = pytest.mark.skipif(not L.has_mkl(), reason="needs MKL")


@pytest.fixture(autouse=True)
def without_the_cpp_library(monkeypatch):
    """The op's Python path: as where kvgraph's C++ library does not build."""
    monkeypatch.setattr(L, "_cpp_linear", None)


def test_with_the_cpp_library_the_op_calls_its_kernel(monkeypatch):
    calls = []

    def kernel(x, w, b, max_rows, pack_rows):
        calls.append((max_rows, pack_rows))
        return F.linear(x, w, b) + 1

    monkeypatch.setattr(L, "_cpp_linear", kernel)
    x, w = torch.randn(3, 16), torch.randn(11, 16)
    with torch.inference_mode():
        out = L.linear(x, w)
    assert calls == [(L.max_packed_rows(), L.PACK_ROWS)]
    torch.testing.assert_close(out, F.linear(x, w) + 1)
    assert not hasattr(w, L._ATTR)  # nothing packed in Python


def test_the_cpp_kernel_is_looked_up_once(monkeypatch):
    from kvgraph.ops import cpp

    lookups = []
    monkeypatch.setattr(L, "_cpp_linear", L._CPP_UNKNOWN)
    monkeypatch.setattr(cpp, "packed_linear_kernel", lambda: lookups.append(1))  # returns None: the Python path
    x, w = torch.randn(3, 16), torch.randn(11, 16)
    with torch.inference_mode():
        for _ in range(3):
            torch.testing.assert_close(L.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert lookups == [1]
    assert hasattr(w, L._ATTR)  # packed by the Python path


@pytest.mark.parametrize("shape", [(1, 7, 48), (5, 48), (1, 1, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_f_linear(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(97, 48, generator=g)
    b = torch.randn(97, generator=g) if with_bias else None
    with torch.inference_mode():
        assert L.uses_packed(x, w)
        out = L.linear(x, w, b)
    assert out.shape == (*shape[:-1], 97)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_mkl
@pytest.mark.parametrize("rows", [1, 2, 17, L.PACK_ROWS - 1, L.PACK_ROWS, L.PACK_ROWS + 1, 200, L.MAX_PACKED_ROWS])
def test_one_mkl_pack_serves_every_row_count(rows):
    """MKL packs for PACK_ROWS rows; the product is F.linear's at any other count as well."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(1, rows, 96, generator=g)
    with torch.inference_mode():
        kind, _ = L.packed_weight(w)
        assert kind == "mkl"
        out = L.linear(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_mkl
def test_a_pack_mkl_gets_wrong_falls_back_to_onednn(monkeypatch, caplog):
    monkeypatch.setattr(L, "_mkl_pack_agrees", lambda weight, packed: False)
    x, w = torch.randn(4, 16), torch.randn(11, 16)
    with torch.inference_mode(), caplog.at_level("WARNING", logger=L.__name__):
        kind, packed = L.packed_weight(w)
        out = L.linear(x, w)
    assert kind == "onednn" and packed.is_mkldnn
    assert "(11, 16)" in caplog.text and "oneDNN" in caplog.text
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_mkl
def test_the_pack_check_tells_a_wrong_pack():
    w = torch.randn(11, 16)
    assert L._mkl_pack_agrees(w, torch.ops.mkl._mkl_reorder_linear_weight(w, L.PACK_ROWS))
    other = torch.randn(11, 16)
    assert not L._mkl_pack_agrees(w, torch.ops.mkl._mkl_reorder_linear_weight(other, L.PACK_ROWS))


def test_packs_once_and_again_after_an_in_place_change():
    x, w = torch.randn(3, 16), torch.randn(11, 16)
    with torch.no_grad():
        first = L.linear(x, w)
        packed = L.packed_weight(w)[1]
        assert L.packed_weight(w)[1] is packed  # cached on the weight
        w.mul_(2)
        assert L.packed_weight(w)[1] is not packed
        torch.testing.assert_close(L.linear(x, w), 2 * first, rtol=1e-5, atol=1e-4)


def test_an_inference_tensor_weight_is_packed_once():
    with torch.inference_mode():
        w = torch.randn(11, 16)
        assert w.is_inference()
        assert L.packed_weight(w)[1] is L.packed_weight(w)[1]


def test_a_non_contiguous_weight_is_packed_as_its_values():
    base = torch.randn(16, 11)
    w = base.t()  # [11, 16], not contiguous
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(L.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_and_grad_mode_run_f_linear(dtype):
    x, w = torch.randn(3, 16, dtype=dtype), torch.randn(11, 16, dtype=dtype)
    with torch.no_grad():
        assert not L.uses_packed(x, w)
        assert torch.equal(L.linear(x, w), F.linear(x, w))
    x32 = torch.randn(3, 16, requires_grad=True)
    assert not L.uses_packed(x32, torch.randn(11, 16))  # autograd: the plain op


def test_fake_impl_gives_the_shape():
    with FakeTensorMode():
        out = torch.ops.kvgraph.linear(torch.empty(1, 5, 16), torch.empty(11, 16), None)
    assert out.shape == (1, 5, 11)


@pytest.mark.parametrize("rows", [0, L.MAX_PACKED_ROWS + 1])
def test_empty_and_prefill_sized_inputs_run_f_linear(rows):
    x, w = torch.randn(rows, 16), torch.randn(11, 16)
    with torch.inference_mode():
        assert torch.equal(L.linear(x, w), F.linear(x, w))
        assert not hasattr(w, L._ATTR)  # nothing was packed


@pytest.mark.parametrize(("gemm", "vendor", "rows"), [
    ("panels", "GenuineIntel", L.MAX_PACKED_ROWS),  # MKL's GEMM behind F.linear is as fast past 512 rows
    ("panels", "AuthenticAMD", L.NO_ROW_LIMIT),  # the panel GEMM stayed faster up to 2048 rows
    ("panels", None, L.MAX_PACKED_ROWS),  # unknown CPU: as measured on the Xeon
    ("mkl", "AuthenticAMD", L.MAX_PACKED_ROWS),  # MKL's packed GEMM: its own limit
    (None, "AuthenticAMD", L.MAX_PACKED_ROWS),
])
def test_the_packed_row_limit_follows_the_gemm_and_the_cpu(monkeypatch, gemm, vendor, rows):
    from kvgraph.ops import cpp

    monkeypatch.setattr(cpp, "packed_linear_gemm", lambda: gemm)
    monkeypatch.setattr(L, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(L, "_max_rows", None)
    assert L.max_packed_rows() == rows
    monkeypatch.setattr(L, "cpu_vendor", lambda: "something else")
    assert L.max_packed_rows() == rows  # decided once per process


def test_the_cpu_vendor_is_read_from_proc_cpuinfo():
    vendor = L.cpu_vendor()
    try:
        with open("/proc/cpuinfo") as f:
            expected = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        expected = None
    assert vendor == expected
