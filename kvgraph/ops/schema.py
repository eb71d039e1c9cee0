"""The argument list of ``kvgraph::ragged_attention``, written once.

:class:`AttentionArgs` is the op's contract: its fields are the op's arguments in order, with
their types and defaults; :data:`SCHEMA` (the ``torch.library`` schema the op is defined with) is
generated from it, and every implementation takes one ``AttentionArgs``.
"""

from __future__ import annotations

import typing
from typing import NamedTuple

import torch


class AttentionArgs(NamedTuple):
    """The arguments of ``kvgraph::ragged_attention``, in the op's order.

    Attributes:
        q: ``[T, Hq, D]`` new tokens of all sequences, flattened (ragged).
        k: ``[T, Hkv, D]``, ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
        v: ``[T, Hkv, D]``, like ``k``.
        kv_blocks: written in place. Paged ``[total_num_pages, 2, num_layers, page_size, Hkv, D]``;
            continuous ``[max_batch_size, 2, num_layers, max_seq_len, Hkv, D]``; axis 1: 0 = K, 1 = V.
        cache_lengths: ``int32 [batch]`` tokens cached before this step.
        lookup_table: ``int32``; paged ``[batch, max_num_pages]`` (unused = ``total_num_pages``),
            continuous ``[batch]`` (slot of each sequence).
        input_row_offsets: ``int32 [batch + 1]`` prefix sums of new tokens per sequence.
        max_lengths: ``int32 [num_steps, 2]`` on the CPU; row 0 = ``[max new, max cached + new]``.
        layer_idx: the layer of the cache to write and read.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        sliding_window: ``w`` >= 1: the token at position ``p`` sees only positions ``p - w + 1..p``
            (the cache still holds every position); ``None``: all of ``0..p``.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before softmax; ``None``: unchanged.
        kv_scales: written in place with ``kv_blocks`` when the cache is quantized (``kv_blocks`` then
            ``torch.int8`` or ``torch.float8_e4m3fn``): float32 ``kv_blocks``' shape with the last dim
            ``D // group``; element ``d`` of a row is ``kv_blocks[..., d] * kv_scales[..., d // group]``
            (:mod:`kvgraph.cache.quant`). ``None``: ``kv_blocks`` holds q's dtype.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    max_lengths: torch.Tensor
    layer_idx: int
    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    kv_scales: torch.Tensor | None = None


MUTATED = frozenset({"kv_blocks", "kv_scales"})
"""Arguments the op writes in place."""

_SCHEMA_TYPES = {
    torch.Tensor: "Tensor", int: "int", float | None: "float?", int | None: "int?", torch.Tensor | None: "Tensor?",
}


def _schema() -> str:
    """``(Tensor q, ..., Tensor(a!) kv_blocks, ..., Tensor(b!)? kv_scales=None) -> Tensor`` from
    :class:`AttentionArgs`: each mutated argument gets an alias set of its own (``a``, ``b``, ...)."""
    hints = typing.get_type_hints(AttentionArgs)
    defaults = AttentionArgs._field_defaults
    params = []
    aliases = iter("abcdefgh")
    for name in AttentionArgs._fields:
        kind = _SCHEMA_TYPES[hints[name]]
        if name in MUTATED:
            optional = kind.endswith("?")
            kind = f"{kind.removesuffix('?')}({next(aliases)}!){'?' if optional else ''}"
        default = f"={defaults[name]!r}" if name in defaults else ""
        params.append(f"{kind} {name}{default}")
    return f"({', '.join(params)}) -> Tensor"


SCHEMA = _schema()
"""The op's ``torch.library`` schema (without its name)."""
