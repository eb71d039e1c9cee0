"""Validation of the Triton wrappers' arguments, on top of the op's own checks (:mod:`kvgraph.ops.plan`).

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
from kvgraph.ops.plan import StepPlan
from kvgraph.ops.schema import AttentionArgs

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the padded head dim of a tile; larger heads do not fit the kernels' registers
MAX_SCALE_GROUPS = 16  # scales per row of a quantized cache: the store kernel unrolls one step per group
FP8_CAPABILITY = (8, 9)  # the first CUDA architecture Triton converts float8_e4m3fn on (Ada, Hopper)


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


def check_launch(args: AttentionArgs, plan: StepPlan) -> LaunchPlan:
    """Check what the Triton kernels need beyond the op's own checks (``plan``'s, done by
    :func:`~kvgraph.ops.plan.plan_for`), and derive their launch parameters.

    Per step (once, kept in ``plan``): a CUDA device (or the CPU under ``TRITON_INTERPRET=1``),
    fp32/fp16/bf16 (q's dtype for a quantized cache, whose scales are at most ``MAX_SCALE_GROUPS``
    per row, contiguous along them, and float8 storage only from compute capability
    ``FP8_CAPABILITY``), head_dim at most ``MAX_HEAD_DIM``, kv_blocks contiguous along head_dim,
    contiguous ``cache_lengths`` / ``input_row_offsets``, and ``max_lengths[0]`` consistent with
    the token count and within what one sequence can hold. Per layer: q/k/v contiguous along
    head_dim and an int ``layer_idx``.
    """
    max_new, max_context, capacity = plan.derived((check_launch, args.q.shape[0]), lambda: _check_step(args, plan))
    for name, t in (("q", args.q), ("k", args.k), ("v", args.v)):
        if t.stride(-1) != 1:
            raise CacheInputError(f"{name} must be contiguous along head_dim, got strides {t.stride()}")
    if isinstance(args.layer_idx, bool):
        raise CacheInputError(f"layer_idx must be an int, got {args.layer_idx!r}")
    scale, sliding_window, softcap = args.scale, args.sliding_window, args.softcap
    # a window no sequence can outgrow hides nothing; 0 also keeps huge windows out of the kernels' int32
    window = 0 if sliding_window is None or sliding_window >= capacity else sliding_window
    return LaunchPlan(max_new, max_context, 1.0 / math.sqrt(plan.head_dim) if scale is None else float(scale), window,
                      None if softcap is None else float(softcap))


def _check_step(args: AttentionArgs, plan: StepPlan) -> tuple[int, int, int]:
    """The per-step half of :func:`check_launch`: ``(max_new, max_context, capacity)`` of a step the kernels take."""
    device = plan.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise CacheInputError(
            f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}"
        )
    dtype = plan.dtype if plan.scale_group is None else args.q.dtype
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise CacheInputError(f"dtype {dtype} is not supported by the Triton kernels; expected one of {names}")
    if plan.scale_group is not None:
        _check_quantized(plan)
        if args.kv_scales.stride(-1) != 1:
            raise CacheInputError(
                f"kv_scales must be contiguous along its last dim, got strides {args.kv_scales.stride()}"
            )
    if plan.head_dim > MAX_HEAD_DIM:
        raise CacheInputError(f"head_dim {plan.head_dim} exceeds the Triton kernels' limit {MAX_HEAD_DIM}")
    if args.kv_blocks.stride(-1) != 1:
        raise CacheInputError(f"kv_blocks must be contiguous along head_dim, got strides {args.kv_blocks.stride()}")
    for name, t in (("cache_lengths", args.cache_lengths), ("input_row_offsets", args.input_row_offsets)):
        if not t.is_contiguous():
            raise CacheInputError(f"{name} must be contiguous, got strides {t.stride()}")
    max_new, max_context = (int(x) for x in args.max_lengths[0].tolist())
    num_tokens = args.q.shape[0]
    if num_tokens > 0 and not 1 <= max_new <= num_tokens:
        raise CacheInputError(f"max_lengths[0, 0] = {max_new} must be in [1, {num_tokens}] for {num_tokens} new tokens")
    lookup_table = args.lookup_table
    capacity = args.kv_blocks.shape[3] * (lookup_table.shape[1] if lookup_table.dim() == 2 else 1)
    if max_context > capacity:
        raise CacheInputError(
            f"max_lengths[0, 1] = {max_context} exceeds the {capacity} positions one sequence can hold"
        )
    return max_new, max_context, capacity


def _check_quantized(plan: StepPlan) -> None:
    """What the kernels need of a quantized cache: at most ``MAX_SCALE_GROUPS`` scales per row, and
    a device that converts float8_e4m3fn for that storage."""
    groups = plan.head_dim // plan.scale_group
    if groups > MAX_SCALE_GROUPS:
        raise CacheInputError(
            f"{groups} scales per row (head_dim {plan.head_dim}, {plan.scale_group} elements per scale) exceed the "
            f"Triton kernels' {MAX_SCALE_GROUPS}: use a quantization_granularity of at least "
            f"{plan.head_dim // MAX_SCALE_GROUPS}"
        )
    if plan.dtype == torch.float8_e4m3fn and plan.device.type == "cuda":
        capability = torch.cuda.get_device_capability(plan.device)
        if capability < FP8_CAPABILITY:
            raise CacheInputError(
                f"a float8_e4m3fn cache needs compute capability {FP8_CAPABILITY} or newer for the Triton kernels; "
                f"{plan.device} has {capability} (use an int8 cache)"
            )
