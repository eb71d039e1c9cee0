"""Views over one batch's KV cache (MAX's ``ContinuousBatchingKVCacheCollection`` / ``PagedKVCache``).

A collection is built as MAX's, ``(blocks, cache_lengths, lookup_table, max_seq_length,
max_cache_length)``, or from one step's :class:`~kvgraph.cache.inputs.RaggedKVCacheInputs` with
``from_inputs``. It owns nothing:
``get_key_cache(layer)`` / ``get_value_cache(layer)`` return per-layer views whose
``blocks`` is a strided view into the shared ``blocks`` tensor, so ``store`` writes
the cache in place. Unlike MAX's scalar ``load``/``store``, these are vectorised
over index tensors: ``load(batch_idx [N], tok_idx [N]) -> [N, Hkv, D]``. Over a quantized cache
(``kv_scales`` given) ``store`` quantizes and ``load`` / ``load_padded`` dequantize to float32
(:mod:`kvgraph.cache.quant`).
"""

from __future__ import annotations

import abc

import torch

from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.quant import dequantize, quantize, scales_shape_problem
from kvgraph.errors import CacheInputError

KEY, VALUE = 0, 1  # axis 1 of the blocks tensor

Index = int | torch.Tensor


def _as_index(x: Index, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, device=device).long()


class _LayerCache(abc.ABC):
    """One layer's K or V cache for the sequences of a batch.

    Attributes:
        blocks: ``[num_blocks, rows_per_block, Hkv, D]``, a view into the batch's
            ``blocks`` tensor (paged: one block per page; continuous: one per slot).
        cache_lengths: ``int32 [batch]``: tokens cached before this step.
        lookup_table: ``int32``; paged ``[batch, max_num_pages]``, continuous ``[batch]``.
        max_seq_length: most new tokens of any sequence in the step (``max_lengths[0, 0]``).
        max_cache_length: most cached + new tokens of any sequence (``max_lengths[0, 1]``).
        scales: a quantized cache's float32 ``[num_blocks, rows_per_block, Hkv, D // group]``
            (a view like ``blocks``); ``None`` unquantized.
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        max_seq_length: int,
        max_cache_length: int,
        scales: torch.Tensor | None = None,
    ) -> None:
        if blocks.dim() != 4:
            raise CacheInputError(
                f"a layer cache needs blocks of rank 4 [blocks, rows, Hkv, D], got shape {tuple(blocks.shape)}"
            )
        if scales is not None and (scales.shape[:3] != blocks.shape[:3] or blocks.shape[3] % max(scales.shape[3], 1)):
            raise CacheInputError(
                f"scales {tuple(scales.shape)} must be blocks {tuple(blocks.shape)} with a last dim dividing "
                f"head_dim {blocks.shape[3]}"
            )
        self.blocks = blocks
        self.scales = scales
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.max_seq_length = int(max_seq_length)
        self.max_cache_length = int(max_cache_length)

    @property
    def n_kv_heads(self) -> int:
        return self.blocks.shape[2]

    @property
    def head_dim(self) -> int:
        return self.blocks.shape[3]

    @abc.abstractmethod
    def _locate(self, batch_idx: torch.Tensor, tok_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block, row)`` of token ``tok_idx`` of batch entry ``batch_idx`` (int64, same shape)."""

    def cache_length(self, batch_idx: int) -> int:
        """Tokens of batch entry ``batch_idx`` cached before this step."""
        return int(self.cache_lengths[batch_idx])

    def row_idx(self, batch_idx: Index, tok_idx: Index) -> torch.Tensor:
        """Row of a token when the blocks are viewed as a ``[num_blocks * rows_per_block, Hkv * D]`` matrix.

        ``batch_idx`` and ``tok_idx`` are ints or broadcastable integer tensors; returns int64.
        """
        device = self.blocks.device
        block, row = self._locate(_as_index(batch_idx, device), _as_index(tok_idx, device))
        return block * self.blocks.shape[1] + row

    def col_idx(self, head_idx: Index) -> torch.Tensor:
        """Column of ``head_idx``'s first element in the ``[rows, Hkv * D]`` matrix view (int64)."""
        return _as_index(head_idx, self.blocks.device) * self.head_dim

    def load(self, batch_idx: Index, tok_idx: Index) -> torch.Tensor:
        """K or V of the given tokens.

        Args:
            batch_idx: integer ``[N]`` (or broadcastable): batch entry of each token.
            tok_idx: integer ``[N]``: position of each token in its sequence.

        Returns:
            ``[N, Hkv, D]`` in the cache dtype, float32 dequantized for a quantized cache (a copy).
        """
        device = self.blocks.device
        block, row = self._locate(_as_index(batch_idx, device), _as_index(tok_idx, device))
        if self.scales is None:
            return self.blocks[block, row]
        return dequantize(self.blocks[block, row], self.scales[block, row])

    def store(self, batch_idx: Index, tok_idx: Index, values: torch.Tensor) -> None:
        """Write ``values [N, Hkv, D]`` at tokens ``tok_idx [N]`` of ``batch_idx [N]``, in place: in the
        cache dtype, or for a quantized cache any floating dtype, quantized with its scales."""
        device = self.blocks.device
        block, row = self._locate(_as_index(batch_idx, device), _as_index(tok_idx, device))
        if self.scales is None:
            self.blocks.index_put_((block, row), values)
            return
        q, scales = quantize(values, self.blocks.dtype, self.head_dim // self.scales.shape[3])
        self.blocks.index_put_((block, row), q)
        self.scales.index_put_((block, row), scales)

    @abc.abstractmethod
    def _gather_blocks(self, max_length: int, blocks: torch.Tensor) -> torch.Tensor:
        """Copies of each batch entry's rows of ``blocks`` (``self.blocks`` or ``self.scales``), in
        token order: ``[batch, rows, Hkv, last dim of blocks]``.

        ``rows`` covers at least ``max_length`` or the entry's whole capacity, whichever is
        less. Rows past an entry's length are whatever the cache holds there.
        """

    def load_padded(self, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
        """The first ``lengths[b]`` tokens of every batch entry, zero padded.

        Copies whole pages (paged) or slot prefixes (continuous) with one ``index_select``,
        then zeroes the rows past each length, so stale or non-finite values there never
        reach the result.

        Args:
            lengths: integer ``[batch]``, each ``<= max_length`` and within the entry's pages.
            max_length: padded length.

        Returns:
            ``[batch, max_length, Hkv, D]`` in the cache dtype (float32 dequantized for a quantized
            cache); rows past ``lengths[b]`` are zero.
        """
        device = self.blocks.device
        out = self._gather_blocks(max_length, self.blocks)[:, :max_length]
        if self.scales is not None:
            out = dequantize(out, self._gather_blocks(max_length, self.scales)[:, :max_length])
        if out.shape[1] < max_length:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, max_length - out.shape[1]))
        # (batch, row) of every padding row: usually few, so zero just those
        pad_b, pad_row = torch.nonzero(
            torch.arange(max_length, device=device)[None, :] >= lengths.to(device)[:, None], as_tuple=True
        )
        out[pad_b, pad_row] = 0
        return out

    def max_prompt_length(self) -> int:
        """Most new tokens of any sequence in this step."""
        return self.max_seq_length

    def max_context_length(self) -> int:
        """Most cached + new tokens of any sequence in this step."""
        return self.max_cache_length

    def empty_cache(self) -> bool:
        """Whether no sequence of the batch has cached tokens (a pure prefill)."""
        return not bool(self.cache_lengths.any())


class PagedKVCache(_LayerCache):
    """One layer's K or V over pages: ``blocks [total_num_pages, page_size, Hkv, D]``.

    Token ``t`` of batch entry ``b`` lives in page ``lookup_table[b, t // page_size]``,
    row ``t % page_size``.
    """

    @property
    def page_size(self) -> int:
        return self.blocks.shape[1]

    def _locate(self, batch_idx: torch.Tensor, tok_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        page = self.lookup_table[batch_idx, tok_idx // self.page_size].long()
        return page, tok_idx % self.page_size

    def _gather_blocks(self, max_length: int, blocks: torch.Tensor) -> torch.Tensor:
        num_pages, page_size = blocks.shape[0], self.page_size
        width = min(-(-max_length // page_size), self.lookup_table.shape[1])
        # table: [batch, width] -> physical page; unused entries (= num_pages) read page 0
        table = self.lookup_table[:, :width].long()
        table = torch.where((table >= 0) & (table < num_pages), table, 0)
        pages = blocks.index_select(0, table.flatten())  # [batch * width, page_size, Hkv, last]
        return pages.view(table.shape[0], width * page_size, self.n_kv_heads, blocks.shape[3])


class ContinuousBatchingKVCache(_LayerCache):
    """One layer's K or V over slots: ``blocks [max_batch_size, max_seq_len, Hkv, D]``.

    Token ``t`` of batch entry ``b`` lives in slot ``lookup_table[b]``, row ``t``.
    """

    def _locate(self, batch_idx: torch.Tensor, tok_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.lookup_table[batch_idx].long()
        return torch.broadcast_tensors(slot, tok_idx)

    def _gather_blocks(self, max_length: int, blocks: torch.Tensor) -> torch.Tensor:
        return blocks[:, :max_length].index_select(0, self.lookup_table.long())


class _Collection:
    """All layers of one batch's cache.

    Attributes:
        blocks: ``[N, 2, num_layers, rows, Hkv, D]`` (the manager's tensor, not a copy).
        cache_lengths: ``int32 [batch]``: tokens cached before this step.
        lookup_table: ``int32``; paged ``[batch, max_num_pages]``, continuous ``[batch]``.
        max_seq_length: most new tokens of any sequence in the step.
        max_cache_length: most cached + new tokens of any sequence in the step.
        kv_scales: a quantized cache's float32 ``[N, 2, num_layers, rows, Hkv, D // group]``;
            ``None`` unquantized.
    """

    cache_type: type[_LayerCache]
    lookup_rank: int

    def __init__(
        self,
        blocks: torch.Tensor,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        max_seq_length: int,
        max_cache_length: int,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        lookup = lookup_table
        if blocks.dim() != 6 or blocks.shape[1] != 2:
            raise CacheInputError(
                f"blocks must be [N, 2, num_layers, rows, Hkv, D], got shape {tuple(blocks.shape)}"
            )
        if lookup.dim() != self.lookup_rank:
            raise CacheInputError(
                f"{type(self).__name__} needs a lookup_table of rank {self.lookup_rank}, "
                f"got rank {lookup.dim()} (shape {tuple(lookup.shape)})"
            )
        if cache_lengths.dim() != 1 or cache_lengths.shape[0] != lookup.shape[0]:
            raise CacheInputError(
                f"cache_lengths must be [batch] with the lookup_table's batch {lookup.shape[0]}, "
                f"got shape {tuple(cache_lengths.shape)}"
            )
        problem = None if kv_scales is None else scales_shape_problem(tuple(blocks.shape), tuple(kv_scales.shape))
        if problem is not None:
            raise CacheInputError(problem)
        self.blocks = blocks
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.max_seq_length = int(max_seq_length)
        self.max_cache_length = int(max_cache_length)
        self.kv_scales = kv_scales

    @classmethod
    def from_inputs(cls, inputs: RaggedKVCacheInputs) -> _Collection:
        """The collection over one step's inputs; ``max_lengths`` row 0 gives the two maxima."""
        max_lengths = inputs.max_lengths
        if max_lengths.dim() != 2 or max_lengths.shape[0] < 1 or max_lengths.shape[1] != 2:
            raise CacheInputError(f"max_lengths must be [num_steps >= 1, 2], got shape {tuple(max_lengths.shape)}")
        return cls(
            inputs.blocks, inputs.cache_lengths, inputs.lookup_table,
            int(max_lengths[0, 0]), int(max_lengths[0, 1]), inputs.kv_scales,
        )

    @property
    def num_layers(self) -> int:
        return self.blocks.shape[2]

    @property
    def batch_size(self) -> int:
        return self.cache_lengths.shape[0]

    def _layer(self, layer_idx: int, kv: int) -> _LayerCache:
        if not 0 <= layer_idx < self.num_layers:
            raise CacheInputError(f"layer_idx {layer_idx} out of range: the cache has {self.num_layers} layers")
        return self.cache_type(
            self.blocks[:, kv, layer_idx],
            self.cache_lengths,
            self.lookup_table,
            self.max_seq_length,
            self.max_cache_length,
            None if self.kv_scales is None else self.kv_scales[:, kv, layer_idx],
        )

    def get_key_cache(self, layer_idx: int) -> _LayerCache:
        """Keys of layer ``layer_idx``: a view, writes go to the shared blocks."""
        return self._layer(layer_idx, KEY)

    def get_value_cache(self, layer_idx: int) -> _LayerCache:
        """Values of layer ``layer_idx``: a view, writes go to the shared blocks."""
        return self._layer(layer_idx, VALUE)

    def cache_length(self, batch_idx: int) -> int:
        """Tokens of batch entry ``batch_idx`` cached before this step."""
        return int(self.cache_lengths[batch_idx])


class PagedKVCacheCollection(_Collection):
    """Paged batch view: ``blocks [total_num_pages, 2, L, page_size, Hkv, D]``, ``lookup_table [batch, max_num_pages]``."""

    cache_type = PagedKVCache
    lookup_rank = 2


class ContinuousBatchingKVCacheCollection(_Collection):
    """Continuous batch view: ``blocks [max_batch_size, 2, L, max_seq_len, Hkv, D]``, ``lookup_table [batch]``."""

    cache_type = ContinuousBatchingKVCache
    lookup_rank = 1


def collection_for(inputs: RaggedKVCacheInputs) -> PagedKVCacheCollection | ContinuousBatchingKVCacheCollection:
    """The collection class that matches ``inputs.lookup_table``'s rank (2: paged, 1: continuous)."""
    rank = inputs.lookup_table.dim()
    if rank == 2:
        return PagedKVCacheCollection.from_inputs(inputs)
    if rank == 1:
        return ContinuousBatchingKVCacheCollection.from_inputs(inputs)
    raise CacheInputError(
        f"lookup_table must have rank 2 (paged) or 1 (continuous), got rank {rank} "
        f"(shape {tuple(inputs.lookup_table.shape)})"
    )
