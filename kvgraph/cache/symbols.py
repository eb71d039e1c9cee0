"""Typed graph-input descriptions of the KV cache (MAX's ``KVCacheInputSymbols``).

A manager describes the tensors it will hand to a compiled graph as
``TensorType``s whose shape entries are ints or symbolic names
(``"total_num_pages"``, ``"batch_size"``, ``"max_num_pages"``, ``"steps_remaining"``).
:func:`fake_inputs` turns them into fake tensors whose named dims are SymInts of
one ``ShapeEnv`` (the same name is the same symbol across tensors), ready to be
an FX placeholder's ``meta["val"]``.

This module is the graph-input schema the manager, the passes, the runtime binding and the op all
agree on: :func:`ragged_input_symbols` (the KV inputs of a ragged cache), ``KV_PLACEHOLDERS``
(their names and order in a lowered graph) and ``INDEX_DTYPE`` (the dtype of every index tensor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from kvgraph.cache.params import KVCacheParams, KVCacheStrategy
from kvgraph.errors import CacheInputError

Dim = int | str

# Example sizes for symbolic dims when tracing; >= 2 so that torch does not specialise them.
DEFAULT_HINTS: Mapping[str, int] = {
    "total_num_pages": 8,
    "batch_size": 3,
    "max_num_pages": 4,
    "steps_remaining": 2,
    "max_batch_size": 3,
    "total_tokens": 5,
    "batch_size_plus_1": 4,
    "num_logits": 3,
    "max_seq_len": 6,
}

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int32: "si32",
    torch.int64: "si64",
    torch.int8: "si8",
    torch.float8_e4m3fn: "f8E4M3FN",
}


@dataclass(frozen=True)
class TensorType:
    """dtype, shape (ints or symbolic names) and device of one graph input."""

    dtype: torch.dtype
    shape: tuple[Dim, ...]
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "device", torch.device(self.device))
        for d in self.shape:
            if not (isinstance(d, str) or (isinstance(d, int) and d >= 0)):
                raise CacheInputError(f"shape entries must be names or non-negative ints, got {d!r}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def symbolic_dims(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{_DTYPE_SHORT.get(self.dtype, str(self.dtype))}[{dims}] {self.device}"

    def check(self, tensor: torch.Tensor, name: str, bound: dict[str, int] | None = None) -> None:
        """Raise ``CacheInputError`` unless ``tensor`` fits this type.

        ``bound`` collects the sizes of symbolic dims seen so far, so that one
        name takes one size across the tensors of an input set.
        """
        if tensor.dtype != self.dtype:
            raise CacheInputError(f"{name}: dtype {tensor.dtype} does not match expected {self.dtype}")
        if tensor.device.type != self.device.type:
            raise CacheInputError(f"{name}: device {tensor.device} does not match expected {self.device}")
        if tensor.dim() != self.rank:
            raise CacheInputError(
                f"{name}: rank {tensor.dim()} (shape {tuple(tensor.shape)}) does not match expected {self}"
            )
        bound = {} if bound is None else bound
        for axis, (want, got) in enumerate(zip(self.shape, tensor.shape, strict=True)):
            if isinstance(want, int):
                if want != got:
                    raise CacheInputError(
                        f"{name}: dim {axis} is {got}, expected {want} (shape {tuple(tensor.shape)} vs {self})"
                    )
            elif bound.setdefault(want, got) != got:
                raise CacheInputError(
                    f"{name}: dim {axis} ({want}) is {got}, but {want} is {bound[want]} elsewhere"
                )

    def fake(self, fake_mode: FakeTensorMode, syms: Mapping[str, torch.SymInt]) -> FakeTensor:
        """A fake tensor of this type whose named dims are the SymInts in ``syms``."""
        sizes = [syms[d] if isinstance(d, str) else d for d in self.shape]
        with fake_mode:
            return torch.empty(sizes, dtype=self.dtype, device=self.device)


class _SymbolSet:
    """Mixin: a dataclass of ``TensorType`` fields that iterates and indexes like MAX's symbols.

    An optional field left ``None`` (``kv_scales`` of an unquantized cache) is not an input: it is
    skipped by iteration, ``len`` and ``names``.
    """

    def __iter__(self) -> Iterator:
        return iter(getattr(self, name) for name in self.names())

    def __getitem__(self, index: int):
        return list(self)[index]

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

    def items(self) -> list[tuple[str, TensorType]]:
        return list(zip(self.names(), self, strict=True))


class KVCacheInputSymbols(_SymbolSet):
    """Base class of the typed KV inputs a manager adds to a graph.

    As in MAX, a concrete set is a ``@dataclass`` subclass whose fields are ``TensorType``s.
    """


@dataclass
class RaggedKVCacheInputSymbols(KVCacheInputSymbols):
    """``kv_blocks``, ``cache_lengths [batch]``, ``lookup_table``, ``max_lengths [steps, 2]`` (CPU),
    and for a quantized cache ``kv_scales`` (float32, ``kv_blocks``' layout with the last dim
    ``head_dim // scale_group``; ``None`` otherwise), as MAX's."""

    kv_blocks: TensorType
    cache_lengths: TensorType
    lookup_table: TensorType
    max_lengths: TensorType
    kv_scales: TensorType | None = None


@dataclass
class PaddedKVCacheInputSymbols(KVCacheInputSymbols):
    """Padded (non-ragged) cache inputs: separate K and V caches and the start position."""

    k_cache: TensorType
    v_cache: TensorType
    start_pos: TensorType
    null_op: TensorType


INPUT_ROW_OFFSETS = "input_row_offsets"
KV_SCALES = "kv_scales"

KV_PLACEHOLDERS: tuple[str, ...] = (
    *(f.name for f in dataclasses.fields(RaggedKVCacheInputSymbols) if f.name != KV_SCALES),
    INPUT_ROW_OFFSETS,
)
"""Names (and order) of the graph inputs a lowered graph over an unquantized cache takes after the
model's own: the ragged KV symbols, then ``input_row_offsets [batch_size + 1]``
(:func:`kv_placeholders` gives them for any cache)."""


def kv_placeholders(symbols: RaggedKVCacheInputSymbols) -> tuple[str, ...]:
    """The KV placeholders of a graph over ``symbols``: their names (``kv_scales`` after
    ``max_lengths`` for a quantized cache), then ``input_row_offsets``."""
    return (*symbols.names(), INPUT_ROW_OFFSETS)


LOGIT_POSITIONS = "logit_positions"
"""The graph input a lowered graph with pruned logits takes after ``KV_PLACEHOLDERS``: ``int32
[num_logits]``, the indices of the step's new tokens whose logits it returns."""


INDEX_DTYPE = torch.int32
"""The dtype of every index tensor of the cache inputs (MAX uses uint32; torch has little uint32 support)."""


def ragged_input_symbols(
    params: KVCacheParams, device: torch.device | str | None = None
) -> RaggedKVCacheInputSymbols:
    """The typed graph inputs of one device of a ragged cache with ``params``.

    Paged: ``kv_blocks [total_num_pages, 2, L, page_size, H, D]``,
    ``lookup_table [batch_size, max_num_pages]``. Continuous:
    ``kv_blocks [max_batch_size, 2, L, max_seq_len, H, D]``, ``lookup_table [batch_size]``.
    Both: ``cache_lengths [batch_size]``, ``max_lengths [steps_remaining, 2]`` on the CPU, and
    with quantization ``kv_scales`` float32 shaped like ``kv_blocks`` with the last dim
    ``params.scales_per_head``. ``H`` is ``params.n_kv_heads_per_device``; ``device`` defaults to
    ``params.device``.
    """
    L, H, D = params.num_layers, params.n_kv_heads_per_device, params.head_dim
    device = params.device if device is None else torch.device(device)
    if params.cache_strategy is KVCacheStrategy.PAGED:
        blocks = ("total_num_pages", 2, L, params.page_size, H, D)
        lookup = ("batch_size", "max_num_pages")
    else:
        blocks = ("max_batch_size", 2, L, "max_seq_len", H, D)
        lookup = ("batch_size",)
    return RaggedKVCacheInputSymbols(
        kv_blocks=TensorType(params.dtype, blocks, device),
        cache_lengths=TensorType(INDEX_DTYPE, ("batch_size",), device),
        lookup_table=TensorType(INDEX_DTYPE, lookup, device),
        max_lengths=TensorType(INDEX_DTYPE, ("steps_remaining", 2), "cpu"),
        kv_scales=TensorType(params.kvcache_quant_config.scale_dtype, (*blocks[:-1], params.scales_per_head), device)
        if params.quantized else None,
    )


def make_symints(
    names: Sequence[str], shape_env: ShapeEnv, hints: Mapping[str, int] | None = None
) -> dict[str, torch.SymInt]:
    """One dynamic SymInt per name, all in ``shape_env``."""
    from torch._dynamo.source import ConstantSource

    hints = {**DEFAULT_HINTS, **(hints or {})}
    out: dict[str, torch.SymInt] = {}
    for name in names:
        if name in out:
            continue
        source = ConstantSource(f"kv_{name}")
        sym = shape_env.create_symbol(hints.get(name, 4), source=source, dynamic_dim=DimDynamic.DYNAMIC)
        out[name] = shape_env.create_symintnode(sym, hint=hints.get(name, 4), source=source)
    return out


def fake_inputs(
    types: Sequence[TensorType],
    fake_mode: FakeTensorMode | None = None,
    syms: dict[str, torch.SymInt] | None = None,
    hints: Mapping[str, int] | None = None,
) -> list[FakeTensor]:
    """Fake tensors for ``types``; a symbolic name maps to one SymInt across all of them.

    Pass the ``fake_mode`` of the graph being extended (its ``shape_env`` owns the
    new symbols); ``syms`` may carry SymInts already made for names such as
    ``batch_size`` so that other placeholders share them.
    """
    if fake_mode is None:
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    if fake_mode.shape_env is None:
        raise CacheInputError("fake_inputs needs a FakeTensorMode with a ShapeEnv for symbolic dims")
    syms = {} if syms is None else syms
    names = [d for t in types for d in t.symbolic_dims if d not in syms]
    syms.update(make_symints(names, fake_mode.shape_env, hints))
    return [t.fake(fake_mode, syms) for t in types]
