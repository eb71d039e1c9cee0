"""Small helpers shared by the launch wrappers."""

from __future__ import annotations

import contextlib

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
