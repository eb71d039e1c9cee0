"""Tensors handed to a compiled graph at each step (MAX's ``KVCacheInputs``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


class KVCacheInputs:
    """Base class: a dataclass of tensors; iterating flattens to the tensors, as in MAX (an optional
    field left ``None`` is skipped)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, KVCacheInputs):
                yield from value
            elif value is not None:
                yield value

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __getitem__(self, index: int) -> torch.Tensor:
        return list(self)[index]

    def __repr__(self) -> str:
        """Field names with each tensor's dtype, shape and device, not its values (fields left ``None`` omitted)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                dtype = str(value.dtype).removeprefix("torch.")
                value = f"{dtype}{list(value.shape)} {value.device}"
            parts.append(f"{f.name}={value}")
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(repr=False)
class RaggedKVCacheInputs(KVCacheInputs):
    """Inputs of a ragged graph.

    Attributes:
        blocks: the whole cache. Paged: ``[total_num_pages, 2, num_layers, page_size, n_kv_heads, head_dim]``;
            continuous: ``[max_batch_size, 2, num_layers, max_seq_len, n_kv_heads, head_dim]``
            (axis 1: 0 = key, 1 = value).
        cache_lengths: ``int32 [batch]``: tokens already in the cache before this step.
        lookup_table: ``int32``. Paged: ``[batch, max_num_pages]``: ``[batch, logical_page] -> physical_page``,
            unused entries hold ``total_num_pages``. Continuous: ``[batch]``: ``batch -> slot``.
        max_lengths: ``int32 [num_steps, 2]`` on the CPU: row 0 ``[max new tokens, max cached + new]``,
            each later row ``[1, previous + 1]``.
        kv_scales: a quantized cache's float32 scales, laid out like ``blocks`` with the last dim
            ``head_dim // scale_group`` (written in place with ``blocks``); ``None`` unquantized.
    """

    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_lengths: torch.Tensor
    kv_scales: torch.Tensor | None = None

    @property
    def is_paged(self) -> bool:
        return self.lookup_table.dim() == 2

    @property
    def batch_size(self) -> int:
        return self.cache_lengths.shape[0]


@dataclass(repr=False)
class PaddedKVCacheInputs(KVCacheInputs):
    """Inputs of a padded (non-ragged) graph."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start_pos: torch.Tensor
    null_op: torch.Tensor


@dataclass(repr=False)
class KVCacheInputsSequence(KVCacheInputs):
    """A sequence of ``KVCacheInputs`` (one per device, or per step); iterating flattens all of them."""

    kv_cache_inputs: Sequence[KVCacheInputs]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for inputs in self.kv_cache_inputs:
            yield from inputs
