"""Validation of the Triton wrappers' arguments, on top of the op's own :func:`check_inputs`.

Every check raises :class:`kvgraph.errors.CacheInputError` naming the value and the limit it
broke, before anything is launched, so a failed call leaves the cache untouched. Only
metadata and the CPU tensor ``max_lengths`` are read: no device sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kvgraph.errors import CacheInputError
from kvgraph.ops.checks import check_inputs

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the padded head dim of a tile; larger heads do not fit the kernels' registers


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class LaunchPlan:
    """What the wrappers read from validated arguments.

    Attributes:
        max_new: ``max_lengths[0, 0]``, the most new tokens of one sequence.
        max_context: ``max_lengths[0, 1]``, the most cached + new tokens of one sequence.
        scale: the softmax scale (``1/sqrt(D)`` when the caller passed None).
        window: the keys each query sees (``sliding_window``, itself included) as the kernels
            take it: 0 for all before it, also for a window no sequence can outgrow.
        softcap: the attention logit cap ``c`` (scores ``s`` become ``c * tanh(s / c)``), as a
            float; None for none.
    """

    max_new: int
    max_context: int
    scale: float
    window: int = 0
    softcap: float | None = None

    @property
    def max_keys(self) -> int:
        """The most keys one query attends: ``max_context``, or the window where shorter."""
        return min(self.max_context, self.window) if self.window else self.max_context


def check_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    layer_idx: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> LaunchPlan:
    """Check the op's arguments (see ``kvgraph.ops.attention``) and what the Triton kernels need.

    Beyond :func:`check_inputs`: a CUDA device (or the CPU under ``TRITON_INTERPRET=1``),
    fp32/fp16/bf16, head_dim at most ``MAX_HEAD_DIM``, q/k/v/kv_blocks contiguous along
    head_dim, contiguous ``cache_lengths`` / ``input_row_offsets``, an int ``layer_idx``, and
    ``max_lengths[0]`` consistent with the token count and within what one sequence can hold.
    """
    check_inputs(q, k, v, kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, layer_idx, scale,
                 sliding_window, softcap)
    device = q.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise CacheInputError(
            f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise CacheInputError(f"dtype {q.dtype} is not supported by the Triton kernels; expected one of {names}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise CacheInputError(f"head_dim {q.shape[2]} exceeds the Triton kernels' limit {MAX_HEAD_DIM}")
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_blocks", kv_blocks)):
        if t.stride(-1) != 1:
            raise CacheInputError(f"{name} must be contiguous along head_dim, got strides {t.stride()}")
    for name, t in (("cache_lengths", cache_lengths), ("input_row_offsets", input_row_offsets)):
        if not t.is_contiguous():
            raise CacheInputError(f"{name} must be contiguous, got strides {t.stride()}")
    if isinstance(layer_idx, bool):
        raise CacheInputError(f"layer_idx must be an int, got {layer_idx!r}")

    max_new, max_context = (int(x) for x in max_lengths[0].tolist())
    num_tokens = q.shape[0]
    if num_tokens > 0 and not 1 <= max_new <= num_tokens:
        raise CacheInputError(f"max_lengths[0, 0] = {max_new} must be in [1, {num_tokens}] for {num_tokens} new tokens")
    capacity = kv_blocks.shape[3] * (lookup_table.shape[1] if lookup_table.dim() == 2 else 1)
    if max_context > capacity:
        raise CacheInputError(
            f"max_lengths[0, 1] = {max_context} exceeds the {capacity} positions one sequence can hold"
        )
    # a window no sequence can outgrow hides nothing; 0 also keeps huge windows out of the kernels' int32
    window = 0 if sliding_window is None or sliding_window >= capacity else sliding_window
    return LaunchPlan(max_new, max_context, 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale), window,
                      None if softcap is None else float(softcap))
