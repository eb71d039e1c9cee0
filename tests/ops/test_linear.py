"""``kvgraph::linear``: F.linear with a oneDNN-packed weight on the CPU, repacked when the weight changes."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kvgraph.ops import linear as L

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("shape", [(1, 7, 48), (5, 48), (1, 1, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_f_linear(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(97, 48, generator=g)
    b = torch.randn(97, generator=g) if with_bias else None
    with torch.inference_mode():
        assert L.uses_onednn(x, w)
        out = L.linear(x, w, b)
    assert out.shape == (*shape[:-1], 97)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_packs_once_and_again_after_an_in_place_change():
    x, w = torch.randn(3, 16), torch.randn(11, 16)
    with torch.no_grad():
        first = L.linear(x, w)
        packed = L.packed_weight(w)
        assert L.packed_weight(w) is packed  # cached on the weight
        w.mul_(2)
        assert L.packed_weight(w) is not packed
        torch.testing.assert_close(L.linear(x, w), 2 * first, rtol=1e-5, atol=1e-4)


def test_an_inference_tensor_weight_is_packed_once():
    with torch.inference_mode():
        w = torch.randn(11, 16)
        assert w.is_inference()
        assert L.packed_weight(w) is L.packed_weight(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_and_grad_mode_run_f_linear(dtype):
    x, w = torch.randn(3, 16, dtype=dtype), torch.randn(11, 16, dtype=dtype)
    with torch.no_grad():
        assert not L.uses_onednn(x, w)
        assert torch.equal(L.linear(x, w), F.linear(x, w))
    x32 = torch.randn(3, 16, requires_grad=True)
    assert not L.uses_onednn(x32, torch.randn(11, 16))  # autograd: the plain op


def test_fake_impl_gives_the_shape():
    with FakeTensorMode():
        out = torch.ops.kvgraph.linear(torch.empty(1, 5, 16), torch.empty(11, 16), None)
    assert out.shape == (1, 5, 11)


def test_prefill_sized_inputs_run_f_linear():
    x, w = torch.randn(L.MAX_PACKED_ROWS + 1, 16), torch.randn(11, 16)
    with torch.inference_mode():
        assert torch.equal(L.linear(x, w), F.linear(x, w))
