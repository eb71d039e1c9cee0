"""Continuous batching: one contiguous ``max_seq_len`` slot of the cache per sequence (MAX's
``ContinuousBatchingKVCacheManager``)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgraph.errors import InvalidParamsError
from kvgraph.managers.base import (
    INDEX_DTYPE,
    KVCacheManager,
    SequenceState,
    check_memory,
    check_positive_int,
)
from kvgraph.params import KVCacheParams, KVCacheStrategy
from kvgraph.request import KVRequest


@dataclass
class SlotSequence(SequenceState):
    """A sequence and the slot (row of ``blocks``) that holds its cache."""

    slot: int = -1


class ContinuousBatchingKVCacheManager(KVCacheManager):
    """One slot per claimed sequence; every slot has room for ``max_seq_len`` tokens.

    ``blocks``: ``[max_batch_size, 2, num_layers, max_seq_len, n_kv_heads, head_dim]`` of
    ``params.dtype`` on ``params.device``, zero-initialised (axis 1: 0 = key, 1 = value).
    ``lookup_table``: ``int32 [batch]``: ``batch -> slot``.
    """

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int) -> None:
        if params.cache_strategy is not KVCacheStrategy.CONTINUOUS:
            raise InvalidParamsError(
                f"ContinuousBatchingKVCacheManager needs cache_strategy=continuous, "
                f"got {params.cache_strategy.value}"
            )
        super().__init__(params, max_batch_size, max_seq_len)
        L, H, D = params.num_layers, params.n_kv_heads, params.head_dim
        self.blocks = torch.zeros(
            (self.max_batch_size, 2, L, self.max_seq_len, H, D), dtype=params.dtype, device=params.device
        )
        # free slots, lowest first
        self._free_slots = list(range(self.max_batch_size))

    def _new_sequence(self, seq_id: int) -> SlotSequence:
        return SlotSequence(seq_id, slot=heapq.heappop(self._free_slots))

    def _free_sequence(self, seq: SlotSequence) -> None:
        heapq.heappush(self._free_slots, seq.slot)

    def _fits(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> bool:
        return True

    def _reserve(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> None:
        for req, seq in zip(batch, seqs, strict=True):
            seq.reserved = seq.length + len(req.tokens) + num_steps - 1
            seq.hit = 0
            req.cached_tokens = 0

    def _commit(self, seq: SequenceState, req: KVRequest) -> None:
        """Nothing to record: a slot holds each token at its position, found by ``cache_lengths``."""

    def _lookup_table(self, seqs: list[SlotSequence]) -> torch.Tensor:
        # lookup_table: [batch] -> slot
        return torch.tensor([seq.slot for seq in seqs], dtype=INDEX_DTYPE)

    def slot_of(self, seq_id: int) -> int:
        """The slot (row of ``blocks``) that holds ``seq_id``'s cache."""
        with self._lock:
            return self._get(seq_id).slot

    @classmethod
    def estimated_memory_size(
        cls, params: KVCacheParams, max_batch_size: int, max_seq_len: int, available_cache_memory: int
    ) -> int:
        """``max_batch_size * max_seq_len * params.bytes_per_token``: the slots take it all up front,
        whatever ``available_cache_memory`` is."""
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int("max_seq_len", max_seq_len)
        return max_batch_size * max_seq_len * params.bytes_per_token

    @classmethod
    def infer_optimal_batch_size(
        cls, params: KVCacheParams, max_seq_len: int, available_cache_memory: int
    ) -> int:
        """How many ``max_seq_len`` slots fit in ``available_cache_memory`` bytes (0 if none)."""
        check_positive_int("max_seq_len", max_seq_len)
        return check_memory(available_cache_memory) // (max_seq_len * params.bytes_per_token)
