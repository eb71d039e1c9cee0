"""The per-step plan of ``kvgraph::ragged_attention``: the step's metadata checked and derived once.

Every layer of a step passes the op the same five cache tensors (``kv_blocks``, ``cache_lengths``,
``lookup_table``, ``input_row_offsets``, ``max_lengths``). :meth:`StepPlan.build` checks what
depends only on them (ranks, index dtypes, devices, batch sizes) and records what the layers read
(device, dtype, heads, head size, layers, batch); :meth:`StepPlan.check_layer` checks the rest
(q/k/v against the plan, ``layer_idx``, ``scale``, ``sliding_window``, ``softcap``). Both raise
:class:`~kvgraph.errors.CacheInputError` naming the value and the limit, before anything is written.

Inside :func:`bound_step` (which ``kvgraph.bind`` enters) a call whose cache tensors are the
bound ones reuses the step's plan, built at its first layer; any other call (a direct call of
``torch.ops.kvgraph.ragged_attention``, fake tensors while tracing) is checked in full.
Implementations keep what they derive per step in :meth:`StepPlan.derived`, as FlashInfer's
``plan`` / ``run`` split does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kvgraph.cache.quant import STORAGE_DTYPES, scales_shape_problem
from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.errors import CacheInputError
from kvgraph.ops.schema import AttentionArgs

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
T = TypeVar("T")


def _differ(a, b) -> bool:
    """``a != b`` for sizes known now; symbolic sizes (tracing) are not compared, to add no guards."""
    return isinstance(a, int) and isinstance(b, int) and a != b


@dataclass(frozen=True)
class StepPlan:
    """What one step's cache tensors say, checked once; every layer of the step reads it.

    Attributes:
        device: where ``kv_blocks`` and the index tensors (but ``max_lengths``) live.
        dtype: ``kv_blocks``' dtype, which q, k and v share unless the cache is quantized.
        num_layers: ``kv_blocks.shape[2]``.
        n_kv_heads: ``kv_blocks.shape[4]``, the k/v heads.
        head_dim: ``kv_blocks.shape[5]``.
        batch: ``len(cache_lengths)``.
        scale_group: head-dim elements per scale of a quantized cache (``kv_scales`` given), else ``None``.
        derived: what implementations computed for this step (:meth:`derived`).
    """

    device: torch.device
    dtype: torch.dtype
    num_layers: int
    n_kv_heads: int
    head_dim: int
    batch: int
    scale_group: int | None = None
    _derived: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, args: AttentionArgs) -> StepPlan:
        """Check the step's cache tensors in ``args`` (metadata only: no device sync, fake tensors too)."""
        kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, kv_scales = _cache_tensors(args)
        for name, t, rank in (
            ("kv_blocks", kv_blocks, 6), ("cache_lengths", cache_lengths, 1),
            ("input_row_offsets", input_row_offsets, 1), ("max_lengths", max_lengths, 2),
        ):
            if t.dim() != rank:
                raise CacheInputError(f"{name} must have rank {rank}, got rank {t.dim()} (shape {tuple(t.shape)})")
        if lookup_table.dim() not in (1, 2):
            raise CacheInputError(
                f"lookup_table must have rank 2 (paged) or 1 (continuous), got rank {lookup_table.dim()} "
                f"(shape {tuple(lookup_table.shape)})"
            )
        if kv_scales is None and kv_blocks.dtype not in FLOAT_DTYPES:
            hint = " without kv_scales (a quantized cache passes them)" if kv_blocks.dtype in STORAGE_DTYPES else ""
            raise CacheInputError(f"kv_blocks dtype {kv_blocks.dtype} is not one of {FLOAT_DTYPES}{hint}")
        scale_group = None if kv_scales is None else _check_scales(kv_blocks, kv_scales)
        for name, t in (
            ("cache_lengths", cache_lengths), ("lookup_table", lookup_table),
            ("input_row_offsets", input_row_offsets), ("max_lengths", max_lengths),
        ):
            if t.dtype != INDEX_DTYPE:
                raise CacheInputError(f"{name} dtype {t.dtype} must be {INDEX_DTYPE}")
        for name, t in (
            ("cache_lengths", cache_lengths), ("lookup_table", lookup_table), ("input_row_offsets", input_row_offsets),
        ):
            if t.device != kv_blocks.device:
                raise CacheInputError(f"{name} is on {t.device} but kv_blocks is on {kv_blocks.device}")
        if max_lengths.device.type != "cpu":
            raise CacheInputError(f"max_lengths must live on the CPU, got {max_lengths.device}")
        if _differ(kv_blocks.shape[1], 2):
            raise CacheInputError(f"kv_blocks axis 1 must be 2 (key, value), got shape {tuple(kv_blocks.shape)}")
        batch = cache_lengths.shape[0]
        if _differ(lookup_table.shape[0], batch):
            raise CacheInputError(
                f"lookup_table has {lookup_table.shape[0]} rows but batch (cache_lengths) is {batch}"
            )
        if isinstance(batch, int) and _differ(input_row_offsets.shape[0], batch + 1):
            raise CacheInputError(
                f"input_row_offsets has {input_row_offsets.shape[0]} entries, expected batch + 1 = {batch + 1}"
            )
        if _differ(max_lengths.shape[1], 2) or (isinstance(max_lengths.shape[0], int) and max_lengths.shape[0] < 1):
            raise CacheInputError(f"max_lengths must be [num_steps >= 1, 2], got shape {tuple(max_lengths.shape)}")
        _, _, num_layers, _, n_kv_heads, head_dim = kv_blocks.shape
        return cls(kv_blocks.device, kv_blocks.dtype, num_layers, n_kv_heads, head_dim, batch, scale_group)

    def check_layer(self, args: AttentionArgs) -> None:
        """Check one layer's q/k/v against the plan, and ``layer_idx``, ``scale``, ``sliding_window``, ``softcap``."""
        q, k, v = args.q, args.k, args.v
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3:
                raise CacheInputError(f"{name} must have rank 3, got rank {t.dim()} (shape {tuple(t.shape)})")
        if q.dtype not in FLOAT_DTYPES:
            raise CacheInputError(f"q dtype {q.dtype} is not one of {FLOAT_DTYPES}")
        quantized = self.dtype in STORAGE_DTYPES  # build() saw kv_scales with these
        same = (("k", k.dtype), ("v", v.dtype)) + ((("kv_blocks", self.dtype),) if not quantized else ())
        for name, dtype in same:
            if dtype != q.dtype:
                raise CacheInputError(f"{name} dtype {dtype} does not match q dtype {q.dtype}")
        for name, device in (("k", k.device), ("v", v.device), ("kv_blocks", self.device)):
            if device != q.device:
                raise CacheInputError(f"{name} is on {device} but q is on {q.device}")
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        if any(_differ(a, b) for a, b in zip(k.shape, v.shape, strict=True)):
            raise CacheInputError(f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ")
        if _differ(k.shape[0], T):
            raise CacheInputError(f"k has {k.shape[0]} tokens but q has {T}")
        if _differ(k.shape[2], D):
            raise CacheInputError(f"k head_dim {k.shape[2]} does not match q head_dim {D}")
        if isinstance(Hq, int) and isinstance(Hkv, int) and (Hkv == 0 or Hq % Hkv != 0):
            raise CacheInputError(f"q heads {Hq} must be a multiple of k/v heads {Hkv} (GQA)")
        if _differ(self.n_kv_heads, Hkv) or _differ(self.head_dim, D):
            raise CacheInputError(
                f"kv_blocks [.., Hkv, D] = {(self.n_kv_heads, self.head_dim)} does not match "
                f"k/v heads {Hkv}, head_dim {D}"
            )
        layer_idx, scale, sliding_window, softcap = args.layer_idx, args.scale, args.sliding_window, args.softcap
        if not isinstance(layer_idx, int) or (isinstance(self.num_layers, int) and not 0 <= layer_idx < self.num_layers):
            raise CacheInputError(f"layer_idx {layer_idx!r} out of range: kv_blocks has {self.num_layers} layers")
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise CacheInputError(f"scale must be a finite positive float or None, got {scale!r}")
        if sliding_window is not None and (
            not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
        ):
            raise CacheInputError(f"sliding_window must be a positive int (keys seen, itself included) or None, "
                                  f"got {sliding_window!r}")
        if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
            raise CacheInputError(f"softcap must be a finite positive float or None, got {softcap!r}")

    def derived(self, key: object, build: Callable[[], T]) -> T:
        """``build()``, computed at the first call with ``key`` in this step and kept for its other layers.

        ``build`` may raise (``CacheInputError`` for values that do not fit); nothing is kept then.
        """
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]


def _check_scales(kv_blocks: torch.Tensor, kv_scales: torch.Tensor) -> int | None:
    """Head-dim elements per scale of a quantized cache; ``CacheInputError`` unless ``kv_blocks`` is
    8-bit storage and ``kv_scales`` float32 ``kv_blocks``' shape with a last dim dividing head_dim
    (``None`` while tracing symbolic sizes)."""
    if kv_blocks.dtype not in STORAGE_DTYPES:
        raise CacheInputError(
            f"kv_scales needs 8-bit kv_blocks, one of {list(STORAGE_DTYPES)}; got kv_blocks dtype {kv_blocks.dtype}"
        )
    if kv_scales.dtype != torch.float32:
        raise CacheInputError(f"kv_scales dtype {kv_scales.dtype} must be torch.float32")
    if kv_scales.device != kv_blocks.device:
        raise CacheInputError(f"kv_scales is on {kv_scales.device} but kv_blocks is on {kv_blocks.device}")
    problem = scales_shape_problem(tuple(kv_blocks.shape), tuple(kv_scales.shape))
    if problem is not None:
        raise CacheInputError(problem)
    groups, head_dim = kv_scales.shape[5], kv_blocks.shape[5]
    if not (isinstance(groups, int) and isinstance(head_dim, int)):
        return None
    return head_dim // groups


def _cache_tensors(args: AttentionArgs) -> tuple[torch.Tensor | None, ...]:
    """``(kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, kv_scales)`` of ``args``."""
    return (args.kv_blocks, args.cache_lengths, args.lookup_table, args.input_row_offsets, args.max_lengths,
            args.kv_scales)


def _versions(tensors: tuple[torch.Tensor | None, ...]) -> tuple[int | None, ...]:
    """In-place write counters of the index tensors (``None`` for inference tensors, which keep none)."""
    return tuple(None if t.is_inference() else t._version for t in tensors[1:5])


class _Step:
    """One bound step: its cache tensors, the versions of its index tensors, its plan once built."""

    def __init__(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.cache = cache
        self.versions = _versions(cache)
        self.plan: StepPlan | None = None

    def holds(self, args: AttentionArgs) -> bool:
        """Whether ``args`` carries this step's very cache tensors, their index values unwritten since."""
        return all(a is b for a, b in zip(_cache_tensors(args), self.cache, strict=True)) and (
            _versions(self.cache) == self.versions
        )


class _Bound(threading.local):
    def __init__(self) -> None:
        self.steps: list[_Step] = []


_BOUND = _Bound()


@contextlib.contextmanager
def bound_step(
    kv_blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    max_lengths: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> Iterator[None]:
    """Within this block (in this thread), op calls on these cache tensors share one :class:`StepPlan`.

    Shapes are the op's (:class:`~kvgraph.ops.schema.AttentionArgs`). Nothing is checked on
    entry: the first layer builds (and checks) the plan, so a bad step is refused by the op.
    """
    _BOUND.steps.append(_Step((kv_blocks, cache_lengths, lookup_table, input_row_offsets, max_lengths, kv_scales)))
    try:
        yield
    finally:
        _BOUND.steps.pop()


def plan_for(args: AttentionArgs) -> StepPlan:
    """The checked plan of ``args``' step (the bound step's, reused), after checking ``args``' own layer."""
    step = _BOUND.steps[-1] if _BOUND.steps else None
    if step is not None and step.holds(args):
        if step.plan is None:
            step.plan = StepPlan.build(args)
        plan = step.plan
    else:
        plan = StepPlan.build(args)
    plan.check_layer(args)
    return plan


def with_op_arguments(run: Callable[[AttentionArgs, StepPlan], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``run(args, plan)`` as a function of the op's own arguments (the signature of ``AttentionArgs``).

    The function checks its arguments (:func:`plan_for`) before ``run`` is called.
    """

    @functools.wraps(run)
    def call(*args: object, **kwargs: object) -> torch.Tensor:
        op_args = AttentionArgs(*args, **kwargs)
        return run(op_args, plan_for(op_args))

    call.__signature__ = inspect.signature(AttentionArgs)
    return call
