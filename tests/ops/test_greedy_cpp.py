"""``kvgraph_cpu::argmax_rows``: each row's first largest float32 logit, exactly what
``torch.max(dim=-1).indices`` gives: ties to the lowest index, a NaN as the largest (the first
NaN), rows of any length (vector tails) and strides."""

import pytest
import torch

from kvgraph.ops import cpp


@pytest.fixture(scope="module")
def kernel():
    found = cpp.argmax_kernel()
    if found is None:
        pytest.skip("kvgraph's C++ library does not build here")
    return found


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 5), (4, 16), (7, 17), (2, 33), (64, 32000)])
def test_random_rows_match_torch_max(kernel, rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(kernel(x), x.max(dim=-1).indices)


def test_ties_nans_infinities_and_signed_zeros(kernel):
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(0))
    x[0, [5, 30]] = 100.0  # a tie across vectors: the lower index
    x[1, :] = float("-inf")  # every value -inf: index 0
    x[2, [20, 7]] = float("nan")  # the first NaN, whatever the values around it
    x[3, 39] = float("nan")  # a NaN in the tail past the last whole vector
    x[4, :] = 0.0
    x[4, 3] = -0.0  # -0 == +0: the first zero
    x[5, 38] = float("inf")
    x[6, [2, 3]] = 1e30  # a tie within one vector
    got = kernel(x)
    assert got.tolist() == [5, 0, 7, 39, 0, 38, 2]
    assert torch.equal(got, x.max(dim=-1).indices)


def test_strided_rows_and_no_rows(kernel):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernel(x[:, ::2]), x[:, ::2].max(dim=-1).indices)
    assert torch.equal(kernel(x.t().contiguous().t()), x.max(dim=-1).indices)  # rows with a column stride
    assert kernel(torch.empty(0, 32)).shape == (0,)


def test_wrong_arguments_are_named(kernel):
    with pytest.raises(RuntimeError, match="2-D float32 tensor with at least one column, got BFloat16"):
        kernel(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match=r"got Float \[2, 0\]"):
        kernel(torch.empty(2, 0))
