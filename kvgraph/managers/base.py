"""The abstract KV cache manager (MAX's ``KVCacheManager``), shared by both strategies."""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence

import torch

from kvgraph.inputs import RaggedKVCacheInputs
from kvgraph.params import KVCacheParams, KVCacheStrategy
from kvgraph.request import KVRequest
from kvgraph.symbols import RaggedKVCacheInputSymbols, TensorType

INDEX_DTYPE = torch.int32  # MAX uses uint32; torch has little uint32 support.


def ragged_input_symbols(params: KVCacheParams) -> RaggedKVCacheInputSymbols:
    """The typed graph inputs of a ragged cache with ``params``.

    Paged: ``kv_blocks [total_num_pages, 2, L, page_size, H, D]``,
    ``lookup_table [batch_size, max_num_pages]``. Continuous:
    ``kv_blocks [max_batch_size, 2, L, max_seq_len, H, D]``, ``lookup_table [batch_size]``.
    Both: ``cache_lengths [batch_size]``, ``max_lengths [steps_remaining, 2]`` on the CPU.
    """
    L, H, D = params.num_layers, params.n_kv_heads, params.head_dim
    if params.cache_strategy is KVCacheStrategy.PAGED:
        blocks = ("total_num_pages", 2, L, params.page_size, H, D)
        lookup = ("batch_size", "max_num_pages")
    else:
        blocks = ("max_batch_size", 2, L, "max_seq_len", H, D)
        lookup = ("batch_size",)
    return RaggedKVCacheInputSymbols(
        kv_blocks=TensorType(params.dtype, blocks, params.device),
        cache_lengths=TensorType(INDEX_DTYPE, ("batch_size",), params.device),
        lookup_table=TensorType(INDEX_DTYPE, lookup, params.device),
        max_lengths=TensorType(INDEX_DTYPE, ("steps_remaining", 2), "cpu"),
    )


class KVCacheManager(abc.ABC):
    """Owns the cache blocks and the per-sequence bookkeeping.

    Lifecycle of a sequence (as MAX): ``claim`` -> (``fetch`` -> run graph -> ``step``)* -> ``release``.
    Every public method is atomic under ``self._lock``. A caller's mistake raises a
    ``KVCacheError`` subclass and leaves the manager unchanged.
    """

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int) -> None:
        self.params = params
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self._lock = threading.RLock()

    # -- sequence lifecycle --
    @abc.abstractmethod
    def claim(self, n: int) -> list[int]:
        """Reserve ``n`` new sequence ids (raises ``NoFreeSlotsError`` past ``slots_remaining``)."""

    @abc.abstractmethod
    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Reserve ids chosen by the caller (raises ``DuplicateSequenceError`` if any is taken)."""

    @abc.abstractmethod
    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is claimed."""

    @abc.abstractmethod
    def release(self, seq_id: int) -> None:
        """Free ``seq_id`` and its cache (raises ``UnknownSequenceError`` if not claimed)."""

    @property
    @abc.abstractmethod
    def slots_remaining(self) -> int:
        """How many more sequences can be claimed."""

    @abc.abstractmethod
    def cache_length(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` committed to the cache."""

    # -- steps --
    @abc.abstractmethod
    def can_fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> bool:
        """Whether ``fetch(batch, num_steps)`` would find enough cache; caller mistakes still raise."""

    @abc.abstractmethod
    def fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> list[RaggedKVCacheInputs]:
        """Reserve cache for ``num_steps`` steps of ``batch`` and return the graph inputs (one per device)."""

    @abc.abstractmethod
    def step(self, batch: Sequence[KVRequest]) -> None:
        """Commit ``req.tokens[req.cached_tokens:]`` of each fetched request as written to the cache."""

    # -- graph interface --
    def input_symbols(self) -> list[RaggedKVCacheInputSymbols]:
        """The typed KV inputs of graphs that run against this manager (one set per device)."""
        return [ragged_input_symbols(self.params)]

    def num_kv_inputs(self) -> int:
        """Number of KV tensors a graph takes per device."""
        return len(self.input_symbols()[0])

    @abc.abstractmethod
    def increment_cache_lengths(
        self, kv_inputs: list[RaggedKVCacheInputs], prev_model_inputs: torch.Tensor
    ) -> list[RaggedKVCacheInputs]:
        """Inputs for the next step of a multistep run, without a host sync and without touching
        the manager's own lengths: ``cache_lengths += new tokens of the previous step``
        (``prev_model_inputs`` is that step's ``input_row_offsets [batch + 1]``) and ``max_lengths``
        loses its first row."""

    # -- sizing --
    @classmethod
    @abc.abstractmethod
    def estimated_memory_size(
        cls, params: KVCacheParams, max_batch_size: int, max_seq_len: int, available_cache_memory: int
    ) -> int:
        """Bytes the cache blocks of such a manager take."""

    @classmethod
    @abc.abstractmethod
    def infer_optimal_batch_size(
        cls, params: KVCacheParams, max_seq_len: int, available_cache_memory: int
    ) -> int:
        """The largest batch whose cache fits ``available_cache_memory``."""
