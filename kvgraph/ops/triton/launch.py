"""Small helpers shared by the launch wrappers."""

from __future__ import annotations

import contextlib
import math

import torch


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a launch (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def block_programs(num_tokens: int, batch: int, block: int) -> int:
    """Programs covering every ``block``-token block of a ragged batch (see ``locate_block``)."""
    return num_tokens // block + batch


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 products for fp32 (no TF32, as the PyTorch reference)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def log2_softcap(softcap: float | None) -> float:
    """The kernels' ``softcap`` argument: the cap times log2(e), as their scores are in log2 units
    (``c * tanh(s / c)`` times log2(e) is ``c' * tanh(s' / c')`` for ``c' = c * log2(e)``, ``s' = s * log2(e)``);
    1.0, unused, without one."""
    return 1.0 if softcap is None else float(softcap) * math.log2(math.e)
