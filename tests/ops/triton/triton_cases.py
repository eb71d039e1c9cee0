"""Where the Triton kernel tests run, and the reference output they are held to.

Imported by the test modules after ``conftest.py`` has chosen compiled or interpreter mode.
"""

from __future__ import annotations

import pytest
import torch

from kvgraph.ops import reference
from kvgraph.ops.triton.checks import interpreting

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


def reference_output(case, scale: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """The PyTorch reference of the op on a copy of ``case``'s cache: ``[T, Hq, D]``."""
    return reference.ragged_attention(*case.clone().args(), scale=scale, sliding_window=sliding_window,
                                      softcap=softcap)


def windowed_golden(case, sliding_window: int | None, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """``case``'s float64 golden with a sliding window of ``sliding_window`` keys (and scores
    soft-capped at ``softcap``): ``[T, Hq, D]``."""
    return reference.naive_attention_fp64(case.q, case.k, case.v, case.k_cached, case.v_cached,
                                          case.input_row_offsets, scale, sliding_window=sliding_window,
                                          softcap=softcap)


def hide_before(case, first: list[int]) -> None:
    """Overwrite the K/V rows of positions ``0 .. first[b] - 1`` of each sequence ``b`` with NaN,
    in ``case``'s cache: a kernel that reads one of them returns NaN."""
    for b, n in enumerate(first):
        for pos in range(n):
            block, row = case.location(b, pos)
            case.kv_blocks[block, :, case.layer_idx, row] = float("nan")
