"""Continuous batching: one contiguous ``max_seq_len`` slot of the cache per sequence (MAX's
``ContinuousBatchingKVCacheManager``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgraph.cache.managers.base import (
    KVCacheManager,
    SequenceState,
    check_layers_and_devices,
    check_memory,
)
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy, check_positive_int
from kvgraph.cache.request import KVRequest
from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.errors import InvalidParamsError


class ContinuousBatchingKVCacheManager(KVCacheManager):
    """One slot per claimed sequence; every slot has room for ``max_seq_len`` tokens.

    A sequence id *is* its slot: the row of ``blocks`` that holds its cache.

    ``blocks``: ``[max_batch_size, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]``
    of ``params.dtype`` per device, zero-initialised (axis 1: 0 = key, 1 = value).
    ``lookup_table``: ``int32 [batch]``: ``batch -> slot`` (the seq_id).
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int | None = None,
        devices: Sequence[torch.device | str] | None = None,
        session: object | None = None,
    ) -> None:
        if params.cache_strategy is not KVCacheStrategy.CONTINUOUS:
            raise InvalidParamsError(
                f"ContinuousBatchingKVCacheManager needs cache_strategy=continuous, "
                f"got {params.cache_strategy.value}"
            )
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices, session)
        self._allocate_blocks(self.max_batch_size, self.max_seq_len)

    def _new_sequence(self, seq_id: int) -> SequenceState:
        return SequenceState(seq_id)

    def _free_sequence(self, seq: SequenceState) -> None:
        """Nothing to give back: the slot is free again once the id is."""

    def _fits(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> bool:
        return True

    def _reserve(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> None:
        for req, seq in zip(batch, seqs, strict=True):
            seq.reserved = seq.length + len(req.tokens) + num_steps - 1
            seq.hit = 0
            req.cached_tokens = 0

    def _commit(self, seq: SequenceState, req: KVRequest) -> None:
        """Nothing to record: a slot holds each token at its position, found by ``cache_lengths``."""

    def _lookup_table(self, seqs: list[SequenceState]) -> torch.Tensor:
        # lookup_table: [batch] -> slot (= seq_id)
        return torch.tensor([seq.seq_id for seq in seqs], dtype=INDEX_DTYPE)

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[torch.device | str] | None = None,
        **kwargs: object,
    ) -> int:
        """``max_batch_size * max_seq_len * params.bytes_per_token`` over all devices: the slots
        take it all up front, whatever ``available_cache_memory`` is."""
        check_layers_and_devices(params, num_layers, devices)
        check_positive_int("max_batch_size", max_batch_size)
        check_positive_int("max_seq_len", max_seq_len)
        check_memory(available_cache_memory)
        return max_batch_size * max_seq_len * params.bytes_per_token

    @classmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParams,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[torch.device | str] | None = None,
        **kwargs: object,
    ) -> int:
        """How many ``max_seq_len`` slots fit in each device's share of ``available_cache_memory``
        bytes (0 if none)."""
        n = len(check_layers_and_devices(params, num_layers, devices))
        check_positive_int("max_seq_len", max_seq_len)
        per_device = check_memory(available_cache_memory) // n
        return per_device // (max_seq_len * params.bytes_per_token // params.n_devices)
