"""Small helpers shared by the launch wrappers."""

from __future__ import annotations

import contextlib
import math

import torch

from kvgraph.ops.triton.checks import interpreting
from kvgraph.ops.triton.layout import PagedLayer


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a launch (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def block_programs(num_tokens: int, batch: int, block: int) -> int:
    """Programs covering every ``block``-token block of a ragged batch (see ``locate_block``)."""
    return num_tokens // block + batch


FP32_DOT_PRECISION = "tf32x3"
"""``tl.dot``'s precision for fp32 operands: three TF32 tensor-core products per product
(``a_hi b_hi + a_hi b_lo + a_lo b_hi``), within a few fp32 ulps of full ones, where plain TF32
keeps 11 bits. ``"ieee"`` (fp32 FMA, no tensor cores) left an H100's fp32 decode compute-bound at
a quarter of its memory bandwidth (``benchmarks/RESULTS.md``)."""


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: :data:`FP32_DOT_PRECISION` for fp32, as accurate as the PyTorch
    reference's products (``"ieee"`` on ROCm, whose Triton has no ``"tf32x3"``); 16-bit operands
    are exact in any."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if torch.version.hip else FP32_DOT_PRECISION


FP32_SPLIT_PARTS = 3
"""bf16 parts of each fp32 operand of the attention dots over an 8-bit cache with one scale per
row (``tile_kernel.split_dot``): 3 hold all of fp32's significand bits."""


def dot_constexprs(q_dtype: torch.dtype, cache: PagedLayer) -> dict[str, object]:
    """How the attention kernels multiply queries of ``q_dtype`` by ``cache``'s keys and values:
    ``DOT_PRECISION`` (:func:`dot_precision`) and ``SPLIT``, :data:`FP32_SPLIT_PARTS` bf16 dots
    for fp32 queries over an 8-bit cache with one scale per row (``tile_kernel.attend_tile``),
    else 0; 0 under Triton's interpreter too, which has no bf16 ``tl.dot``
    (triton-lang/triton#11584)."""
    quant = cache.quant_constexprs()
    split = quant["QUANT"] and quant["GROUPS"] == 1 and q_dtype == torch.float32 and not interpreting()
    return {"DOT_PRECISION": dot_precision(q_dtype), "SPLIT": FP32_SPLIT_PARTS if split else 0}


def log2_softcap(softcap: float | None) -> float:
    """The kernels' ``softcap`` argument: the cap times log2(e), as their scores are in log2 units
    (``c * tanh(s / c)`` times log2(e) is ``c' * tanh(s' / c')`` for ``c' = c * log2(e)``, ``s' = s * log2(e)``);
    1.0, unused, without one."""
    return 1.0 if softcap is None else float(softcap) * math.log2(math.e)
