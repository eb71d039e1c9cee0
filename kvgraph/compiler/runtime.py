"""Binding one step's KV cache inputs to compiled kvgraph callables (``kvgraph.bind``).

A graph lowered by kvgraph takes five extra inputs after the model's own:
``kv_blocks, cache_lengths, lookup_table, max_lengths, input_row_offsets`` (``kv_scales`` after
``max_lengths`` for a quantized cache, and, when its logits are pruned, ``logit_positions``). The caller does not pass them; it binds them around
the call::

    with kvgraph.bind(manager.fetch(batch), input_row_offsets):
        out = compiled(input_ids=ids, position_ids=pos)

The compiled callable reads the innermost binding of the calling thread at call
time (:func:`require_binding`) and checks it against what its graph was lowered
for (:func:`check_fit`). Bindings nest and are private to their thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvgraph.cache.inputs import KVCacheInputsSequence, RaggedKVCacheInputs
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.cache.quant import scales_shape_problem
from kvgraph.cache.symbols import (
    INDEX_DTYPE,
    KV_PLACEHOLDERS,
    LOGIT_POSITIONS,
    TensorType,
    ragged_input_symbols,
)
from kvgraph.errors import BindingError, CacheInputError
from kvgraph.ops.plan import bound_step

HOW_TO_BIND = (
    "call it inside `with kvgraph.bind(kv_inputs, input_row_offsets):`, where kv_inputs is "
    "manager.fetch(batch) (or one RaggedKVCacheInputs) and input_row_offsets the int32 "
    "[batch + 1] prefix sums of each sequence's new tokens (kvgraph.compiler.step.prepare_step builds them)"
)


class CacheLayout(NamedTuple):
    """What a lowered graph is specialised on besides the model: strategy, page size, device, and
    the storage of a quantized cache."""

    strategy: KVCacheStrategy
    page_size: int | None
    """Tokens per page (paged); ``None`` for the continuous strategy."""
    device: torch.device
    quantization: tuple[torch.dtype, int] | None = None
    """``(storage dtype, head-dim elements per scale)`` of a quantized cache; ``None`` otherwise."""

    @classmethod
    def of(cls, params: KVCacheParams) -> CacheLayout:
        page_size = params.page_size if params.is_paged else None
        quantization = (params.dtype, params.scale_group) if params.quantized else None
        return cls(params.cache_strategy, page_size, torch.device(params.device), quantization)

    def __str__(self) -> str:
        page = f", page_size={self.page_size}" if self.page_size is not None else ""
        quant = ""
        if self.quantization is not None:
            dtype, group = self.quantization
            quant = f", {str(dtype).removeprefix('torch.')} with a scale per {group}"
        return f"{self.strategy.value}{page}{quant} on {self.device}"


@dataclass(frozen=True)
class Binding:
    """The tensors one step binds: the manager's inputs and the new tokens' row offsets.

    Attributes:
        kv_inputs: ``blocks``, ``cache_lengths int32 [batch]``, ``lookup_table int32``
            (paged ``[batch, max_num_pages]``, continuous ``[batch]``), ``max_lengths int32
            [num_steps, 2]`` (CPU), as :class:`~kvgraph.cache.inputs.RaggedKVCacheInputs` documents.
        input_row_offsets: ``int32 [batch + 1]`` prefix sums of the new tokens per sequence.
        logit_positions: ``int32 [num_logits]``: the step's token indices whose logits a pruned
            graph returns, in that order; ``None``: each sequence's last new token
            (``input_row_offsets[1:] - 1``).
    """

    kv_inputs: RaggedKVCacheInputs
    input_row_offsets: torch.Tensor
    logit_positions: torch.Tensor | None = None
    threads: int | None = None
    """Intra-op threads the compiled graphs run this step on; ``None``: the process's count."""

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """``logit_positions``, or each sequence's last new token when none were bound."""
        if self.logit_positions is not None:
            return self.logit_positions
        return self.input_row_offsets[1:] - 1

    @property
    def layout(self) -> CacheLayout:
        """Strategy (from the lookup table's rank), page size (blocks axis 3), device and quantization
        (``kv_scales``' last dim) of the cache."""
        blocks, lookup, scales = self.kv_inputs.blocks, self.kv_inputs.lookup_table, self.kv_inputs.kv_scales
        quantization = None if scales is None else (blocks.dtype, blocks.shape[5] // max(scales.shape[5], 1))
        if lookup.dim() == 2:
            return CacheLayout(KVCacheStrategy.PAGED, blocks.shape[3], blocks.device, quantization)
        return CacheLayout(KVCacheStrategy.CONTINUOUS, None, blocks.device, quantization)

    def tensors(self, names: Sequence[str] = KV_PLACEHOLDERS) -> list[torch.Tensor]:
        """The bound tensors in the order of the graph's KV placeholders ``names``."""
        kv = self.kv_inputs
        by_name = {
            "kv_blocks": kv.blocks, "cache_lengths": kv.cache_lengths, "lookup_table": kv.lookup_table,
            "max_lengths": kv.max_lengths, "input_row_offsets": self.input_row_offsets, "kv_scales": kv.kv_scales,
        }
        if LOGIT_POSITIONS in names:
            by_name[LOGIT_POSITIONS] = self.positions
        return [by_name[name] for name in names]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.bindings: list[Binding] = []


_STACK = _Stack()


def _ragged_inputs(kv_inputs: object) -> RaggedKVCacheInputs:
    """The one ``RaggedKVCacheInputs`` in what ``manager.fetch`` returned (or the object itself)."""
    if isinstance(kv_inputs, KVCacheInputsSequence):
        kv_inputs = list(kv_inputs.kv_cache_inputs)
    if isinstance(kv_inputs, (list, tuple)):
        if len(kv_inputs) != 1:
            raise BindingError(
                f"kvgraph.bind takes the inputs of one device, got a sequence of {len(kv_inputs)}"
            )
        kv_inputs = kv_inputs[0]
    if not isinstance(kv_inputs, RaggedKVCacheInputs):
        raise BindingError(
            f"kvgraph.bind needs a RaggedKVCacheInputs or manager.fetch(...)'s list of one, "
            f"got {type(kv_inputs).__name__}"
        )
    return kv_inputs


def _check_structure(kv: RaggedKVCacheInputs, input_row_offsets: object) -> None:
    """What a binding needs independently of any graph: tensors, ranks, index dtypes, batch sizes."""
    blocks, lookup = kv.blocks, kv.lookup_table
    if blocks.dim() != 6 or blocks.shape[1] != 2:
        raise BindingError(
            f"blocks must be [pages or slots, 2, num_layers, page_size or max_seq_len, n_kv_heads, head_dim], "
            f"got shape {tuple(blocks.shape)}"
        )
    if lookup.dim() not in (1, 2):
        raise BindingError(
            f"lookup_table must be [batch, max_num_pages] (paged) or [batch] (continuous), "
            f"got shape {tuple(lookup.shape)}"
        )
    if not isinstance(input_row_offsets, torch.Tensor):
        raise BindingError(f"input_row_offsets must be a tensor, got {type(input_row_offsets).__name__}")
    batch = kv.cache_lengths.shape[0] if kv.cache_lengths.dim() == 1 else None
    if (
        input_row_offsets.dtype != INDEX_DTYPE
        or input_row_offsets.dim() != 1
        or batch is None
        or input_row_offsets.shape[0] != batch + 1
    ):
        raise BindingError(
            f"input_row_offsets must be {INDEX_DTYPE} [batch + 1] with batch = len(cache_lengths) = {batch}, "
            f"got {input_row_offsets.dtype} {tuple(input_row_offsets.shape)}"
        )
    if input_row_offsets.device != blocks.device:
        raise BindingError(
            f"input_row_offsets is on {input_row_offsets.device} but the cache blocks are on {blocks.device}"
        )
    scales = kv.kv_scales
    problem = None if scales is None else scales_shape_problem(tuple(blocks.shape), tuple(scales.shape))
    if problem is not None:
        raise BindingError(problem)


def _check_positions(positions: object, input_row_offsets: torch.Tensor) -> None:
    """``logit_positions``: ``int32 [num_logits >= 1]`` on the offsets' device, on the CPU each in ``[0, T)``."""
    if not isinstance(positions, torch.Tensor):
        raise BindingError(f"logit_positions must be a tensor, got {type(positions).__name__}")
    if positions.dtype != INDEX_DTYPE or positions.dim() != 1 or positions.shape[0] < 1:
        raise BindingError(
            f"logit_positions must be {INDEX_DTYPE} [num_logits >= 1], got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.device != input_row_offsets.device:
        raise BindingError(
            f"logit_positions is on {positions.device} but input_row_offsets is on {input_row_offsets.device}"
        )
    if positions.device.type == "cpu":
        tokens = int(input_row_offsets[-1])
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= tokens:
            bad = low if low < 0 else high
            raise BindingError(f"logit_positions holds {bad}, outside the step's {tokens} tokens [0, {tokens})")


@contextlib.contextmanager
def bind(
    kv_inputs: RaggedKVCacheInputs | Sequence[RaggedKVCacheInputs] | KVCacheInputsSequence,
    input_row_offsets: torch.Tensor,
    logit_positions: torch.Tensor | None = None,
    threads: int | None = None,
) -> Iterator[Binding]:
    """Bind one step's KV inputs for compiled kvgraph callables called in this thread.

    Args:
        kv_inputs: ``manager.fetch(batch)`` (a list of one ``RaggedKVCacheInputs``) or one
            ``RaggedKVCacheInputs``: ``blocks`` (paged ``[total_num_pages, 2, L, page_size, Hkv, D]``,
            continuous ``[max_batch_size, 2, L, max_seq_len, Hkv, D]``), ``cache_lengths int32 [batch]``,
            ``lookup_table int32`` (``[batch, max_num_pages]`` or ``[batch]``), ``max_lengths int32
            [num_steps, 2]`` on the CPU.
        input_row_offsets: ``int32 [batch + 1]`` on the cache's device: prefix sums of the new
            tokens of each sequence, in the order of ``cache_lengths``.
        logit_positions: ``int32 [num_logits]`` on that device: the indices (into the step's
            flattened new tokens) whose logits a pruned graph returns, in order; ``None`` (the
            default): each sequence's last new token, one row per sequence.

    Raises ``BindingError`` (binding nothing) when the inputs are not of that form. Within the
    block, the op's calls on these tensors share one checked plan of the step (:func:`~kvgraph.ops.plan.bound_step`).
    """
    kv = _ragged_inputs(kv_inputs)
    _check_structure(kv, input_row_offsets)
    if logit_positions is not None:
        _check_positions(logit_positions, input_row_offsets)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BindingError(f"threads must be a positive int or None, got {threads!r}")
    binding = Binding(kv, input_row_offsets, logit_positions, threads)
    _STACK.bindings.append(binding)
    try:
        with bound_step(kv.blocks, kv.cache_lengths, kv.lookup_table, input_row_offsets, kv.max_lengths,
                        kv.kv_scales):
            yield binding
    finally:
        _STACK.bindings.pop()


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block on ``threads`` intra-op threads (``torch.set_num_threads``), the count before
    restored after it; ``None`` or the current count: change nothing."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def current_binding() -> Binding | None:
    """The innermost binding of this thread, or ``None``."""
    bindings = _STACK.bindings
    return bindings[-1] if bindings else None


def require_binding(what: str = "this kvgraph-compiled model") -> Binding:
    """The innermost binding of this thread; ``BindingError`` saying how to bind when there is none."""
    binding = current_binding()
    if binding is None:
        raise BindingError(f"{what} was called without bound KV cache inputs: {HOW_TO_BIND}")
    return binding


def check_fit(binding: Binding, params: KVCacheParams, graph_device: torch.device | None = None) -> None:
    """Raise ``BindingError`` naming both sides unless ``binding`` fits a graph lowered for ``params``.

    Compares strategy, page size, quantization, layers, KV heads, head size, dtype and device of
    the bound cache with ``params`` (and the device with ``graph_device``, where the model's tensors live),
    and the index tensors' dtypes, ranks and batch sizes with the graph's input types.
    """
    need = CacheLayout.of(params)
    have = binding.layout
    devices = [d for d in (need.device, graph_device) if d is not None]
    if have.strategy is not need.strategy or have.page_size != need.page_size or any(
        not _same_device(have.device, d) for d in devices
    ) or have.quantization != need.quantization:
        where = f" (model tensors on {graph_device})" if graph_device is not None else ""
        raise BindingError(f"the bound KV cache is {have}, but the graph was compiled for {need}{where}")
    sizes: dict[str, int] = {}
    try:
        # symbols and tensors both in MAX order: blocks, cache_lengths, lookup_table, max_lengths(, kv_scales)
        for (name, tensor_type), tensor in zip(_input_types(params), binding.kv_inputs, strict=True):
            tensor_type.check(tensor, name, sizes)
    except CacheInputError as e:
        raise BindingError(
            f"the bound KV cache does not fit the graph: {e}. The graph needs "
            f"num_layers={params.num_layers}, n_kv_heads={params.n_kv_heads}, head_dim={params.head_dim}, "
            f"dtype={params.dtype}; the bound blocks are {binding.kv_inputs.blocks.dtype} "
            f"{tuple(binding.kv_inputs.blocks.shape)}"
        ) from None


@functools.lru_cache(maxsize=64)
def _input_types(params: KVCacheParams) -> tuple[tuple[str, TensorType], ...]:
    return tuple(ragged_input_symbols(params).items())


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one (``cuda`` matches ``cuda:1``)."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        return True
    return a.index == b.index
