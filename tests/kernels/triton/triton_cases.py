"""Where the Triton kernel tests run, and the reference output they are held to.

Imported by the test modules after ``conftest.py`` has chosen compiled or interpreter mode.
"""

from __future__ import annotations

import pytest
import torch

from kvgraph.kernels import reference
from kvgraph.kernels.triton.checks import interpreting

DEVICE = "cpu" if interpreting() else "cuda"
COMPILED_CUDA = torch.cuda.is_available() and not interpreting()

_needs_compiled_cuda = pytest.mark.skipif(
    not COMPILED_CUDA, reason="needs a CUDA device and compiled Triton (TRITON_INTERPRET unset)"
)
# Triton's interpreter multiplies the raw bits of bf16 tl.dot operands (triton-lang/triton#11584)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not COMPILED_CUDA, reason="Triton's interpreter has no bf16 tl.dot (triton-lang/triton#11584)"))


def gpu(test):
    """Mark ``test`` as a GPU test: ``@pytest.mark.gpu``, skipped without compiled CUDA Triton."""
    return pytest.mark.gpu(_needs_compiled_cuda(test))


def reference_output(case, scale: float | None = None) -> torch.Tensor:
    """The PyTorch reference of the op on a copy of ``case``'s cache: ``[T, Hq, D]``."""
    return reference.ragged_attention(*case.clone().args(), scale=scale)
