"""The abstract KV cache manager (MAX's ``KVCacheManager``), shared by both strategies.

The base class owns what both strategies share: sequence ids and their lengths,
validation of batches, the step commit, and building the graph inputs. A
strategy adds where a sequence's cache lives (a slot, or a list of pages) by
implementing ``_new_sequence``, ``_free_sequence``, ``_fits``, ``_reserve`` and
``_lookup_table``.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgraph.errors import (
    BatchSizeError,
    CacheInputError,
    DuplicateSequenceError,
    InvalidParamsError,
    NoFreeSlotsError,
    SequenceLengthError,
    StepError,
    UnknownSequenceError,
)
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


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int, else ``InvalidParamsError`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidParamsError(f"{name} must be a positive int, got {value!r}")
    return value


def check_memory(available_cache_memory: object) -> int:
    """``available_cache_memory`` if it is a non-negative int (bytes), else ``InvalidParamsError``."""
    value = available_cache_memory
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidParamsError(f"available_cache_memory must be a non-negative int, got {value!r}")
    return value


def max_lengths_tensor(new_counts: Sequence[int], totals: Sequence[int], num_steps: int) -> torch.Tensor:
    """``int32 [num_steps, 2]`` on the CPU: row 0 ``[max new, max total]``, row j ``[1, row0[1] + j]``."""
    max_total = max(totals)
    rows = [[max(new_counts), max_total]] + [[1, max_total + j] for j in range(1, num_steps)]
    return torch.tensor(rows, dtype=INDEX_DTYPE)


@dataclass
class SequenceState:
    """Bookkeeping of one claimed sequence (no tensors)."""

    seq_id: int
    length: int = 0
    """Tokens in the cache: committed by ``step``, plus a prefix-cache hit of the pending fetch."""
    reserved: int | None = None
    """Cache length the pending fetch made room for; ``None`` when no fetch awaits its ``step``."""
    hit: int = 0
    """``cached_tokens`` the pending fetch set on the request (a prefix-cache hit)."""
    stepped: bool = False
    """Whether ``step`` has committed tokens; until then a fetch starts the sequence afresh."""

    @property
    def start(self) -> int:
        """Cache length a fetch builds on: a never-stepped sequence is planned from empty."""
        return self.length if self.stepped else 0


class KVCacheManager(abc.ABC):
    """Owns the cache blocks and the per-sequence bookkeeping.

    Lifecycle of a sequence (as MAX): ``claim`` -> (``fetch`` -> run graph -> ``step``)* -> ``release``.
    Every public method is atomic under ``self._lock``. A caller's mistake raises a
    ``KVCacheError`` subclass and leaves the manager unchanged.

    Attributes:
        blocks: the cache tensor (layout per strategy, see ``ragged_input_symbols``); ``fetch``
            returns it as is, the attention op writes into it.
    """

    blocks: torch.Tensor

    def __init__(self, params: KVCacheParams, max_batch_size: int, max_seq_len: int) -> None:
        self.params = params
        self.max_batch_size = check_positive_int("max_batch_size", max_batch_size)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self._lock = threading.RLock()
        self._seqs: dict[int, SequenceState] = {}
        self._next_id = 0

    # -- strategy hooks (called under the lock) --
    @abc.abstractmethod
    def _new_sequence(self, seq_id: int) -> SequenceState:
        """State of a newly claimed sequence; a slot is free (checked by the caller)."""

    @abc.abstractmethod
    def _free_sequence(self, seq: SequenceState) -> None:
        """Give back everything ``seq`` holds."""

    @abc.abstractmethod
    def _fits(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> bool:
        """Whether ``_reserve`` would succeed; changes nothing."""

    @abc.abstractmethod
    def _reserve(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> None:
        """Make room for the validated ``batch``: set each ``seq.length/reserved/hit`` and each
        ``req.cached_tokens``. Raises ``OutOfPagesError`` before changing anything."""

    @abc.abstractmethod
    def _lookup_table(self, seqs: list[SequenceState]) -> torch.Tensor:
        """``int32`` lookup table of ``seqs`` (on the CPU; moved to the device by the caller)."""

    @abc.abstractmethod
    def _commit(self, seq: SequenceState, req: KVRequest) -> None:
        """``step`` is about to commit ``req.tokens[req.cached_tokens:]`` to ``seq`` (still unchanged)."""

    # -- sequence lifecycle --
    def claim(self, n: int) -> list[int]:
        """Reserve ``n`` new sequence ids (raises ``NoFreeSlotsError`` past ``slots_remaining``)."""
        with self._lock:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise BatchSizeError(f"claim needs a non-negative int count, got {n!r}")
            if n > self.slots_remaining:
                raise NoFreeSlotsError(
                    f"claim({n}) exceeds slots_remaining={self.slots_remaining} "
                    f"(max_batch_size={self.max_batch_size})"
                )
            ids = []
            while len(ids) < n:
                if self._next_id not in self._seqs:
                    ids.append(self._next_id)
                self._next_id += 1
            for seq_id in ids:
                self._seqs[seq_id] = self._new_sequence(seq_id)
            return ids

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Reserve ids chosen by the caller (raises ``DuplicateSequenceError`` if any is taken)."""
        with self._lock:
            ids = list(seq_ids)
            for seq_id in ids:
                if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 0:
                    raise InvalidParamsError(f"seq_id must be a non-negative int, got {seq_id!r}")
                if seq_id in self._seqs:
                    raise DuplicateSequenceError(f"seq_id {seq_id} is already claimed")
            if len(set(ids)) != len(ids):
                raise DuplicateSequenceError(f"seq_ids {ids} repeat an id")
            if len(ids) > self.slots_remaining:
                raise NoFreeSlotsError(
                    f"external_claim of {len(ids)} ids exceeds slots_remaining={self.slots_remaining}"
                )
            for seq_id in ids:
                self._seqs[seq_id] = self._new_sequence(seq_id)

    def contains(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is claimed."""
        with self._lock:
            return seq_id in self._seqs

    def release(self, seq_id: int) -> None:
        """Free ``seq_id`` and its cache (raises ``UnknownSequenceError`` if not claimed)."""
        with self._lock:
            seq = self._get(seq_id)
            self._free_sequence(seq)
            del self._seqs[seq_id]

    @property
    def slots_remaining(self) -> int:
        """How many more sequences can be claimed."""
        with self._lock:
            return self.max_batch_size - len(self._seqs)

    def cache_length(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` in the cache (committed, plus a prefix hit of a pending fetch)."""
        with self._lock:
            return self._get(seq_id).length

    def cached_prefix_length(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` that a sequence's first ``fetch`` with them would take from
        the prefix cache now (always below ``len(tokens)``); 0 without prefix caching.

        Lets a scheduler that chunks prefills start after the hit: first chunk
        ``prompt[: hit + budget]``.
        """
        return 0

    # -- steps --
    def can_fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> bool:
        """Whether ``fetch(batch, num_steps)`` would find enough cache; caller mistakes still raise."""
        with self._lock:
            seqs = self._check_fetch(batch, num_steps)
            return self._fits(batch, seqs, num_steps)

    def fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> list[RaggedKVCacheInputs]:
        """Reserve cache for ``num_steps`` steps of ``batch`` and return the graph inputs (one per device).

        Each sequence gets room for ``len(req.new_tokens) + num_steps - 1`` more tokens; a fetch
        of a sequence that was fetched but not stepped replaces that reservation. Sets
        ``req.cached_tokens`` (a prefix-cache hit on a sequence's first fetch, else 0).

        Returns one ``RaggedKVCacheInputs``: ``blocks`` (this manager's tensor), ``cache_lengths
        int32 [batch]``, ``lookup_table int32`` and ``max_lengths int32 [num_steps, 2]`` (CPU).
        """
        with self._lock:
            seqs = self._check_fetch(batch, num_steps)
            self._reserve(batch, seqs, num_steps)
            new_counts = [len(req.tokens) - req.cached_tokens for req in batch]
            lengths = [seq.length for seq in seqs]
            device = self.params.device
            return [
                RaggedKVCacheInputs(
                    blocks=self.blocks,
                    cache_lengths=torch.tensor(lengths, dtype=INDEX_DTYPE).to(device),
                    lookup_table=self._lookup_table(seqs).to(device),
                    max_lengths=max_lengths_tensor(
                        new_counts, [c + n for c, n in zip(lengths, new_counts, strict=True)], num_steps
                    ),
                )
            ]

    def step(self, batch: Sequence[KVRequest]) -> None:
        """Commit ``req.tokens[req.cached_tokens:]`` of each fetched request as written to the cache."""
        with self._lock:
            seqs = self._check_batch(batch)
            for req, seq in zip(batch, seqs, strict=True):
                if seq.reserved is None:
                    raise StepError(f"step of seq {seq.seq_id}, which has no pending fetch")
                if req.cached_tokens != seq.hit:
                    raise StepError(
                        f"seq {seq.seq_id}: cached_tokens={req.cached_tokens}, but fetch set {seq.hit}"
                    )
                total = seq.length + len(req.tokens) - req.cached_tokens
                if total > seq.reserved:
                    raise StepError(
                        f"seq {seq.seq_id}: step commits {total - seq.length} tokens to a cache of "
                        f"{seq.length}, past the {seq.reserved} reserved by fetch"
                    )
            for req, seq in zip(batch, seqs, strict=True):
                self._commit(seq, req)
                seq.length += len(req.tokens) - req.cached_tokens
                seq.reserved = None
                seq.hit = 0
                seq.stepped = True

    # -- graph interface --
    def input_symbols(self) -> list[RaggedKVCacheInputSymbols]:
        """The typed KV inputs of graphs that run against this manager (one set per device)."""
        return [ragged_input_symbols(self.params)]

    def num_kv_inputs(self) -> int:
        """Number of KV tensors a graph takes per device."""
        return len(self.input_symbols()[0])

    def increment_cache_lengths(
        self, kv_inputs: list[RaggedKVCacheInputs], prev_model_inputs: torch.Tensor
    ) -> list[RaggedKVCacheInputs]:
        """Inputs for the next step of a multistep run, without a host sync and without touching
        the manager's own lengths: ``cache_lengths += new tokens of the previous step``
        (``prev_model_inputs`` is that step's ``input_row_offsets int32 [batch + 1]``) and
        ``max_lengths`` loses its first row."""
        with self._lock:
            return [self._increment(inputs, prev_model_inputs) for inputs in kv_inputs]

    @staticmethod
    def _increment(inputs: RaggedKVCacheInputs, prev_model_inputs: torch.Tensor) -> RaggedKVCacheInputs:
        """``increment_cache_lengths`` of one device's inputs."""
        batch = inputs.cache_lengths.shape[0]
        if prev_model_inputs.dim() != 1 or prev_model_inputs.shape[0] != batch + 1:
            raise CacheInputError(
                f"input_row_offsets has shape {tuple(prev_model_inputs.shape)}, expected ({batch + 1},)"
            )
        if inputs.max_lengths.shape[0] < 2:
            raise CacheInputError(
                f"max_lengths has {inputs.max_lengths.shape[0]} row(s): no step remains to increment to"
            )
        # offs: [batch + 1] -> new tokens per sequence: [batch]
        offs = prev_model_inputs.to(inputs.cache_lengths.device, non_blocking=True)
        new = (offs[1:] - offs[:-1]).to(INDEX_DTYPE)
        return RaggedKVCacheInputs(
            blocks=inputs.blocks,
            cache_lengths=inputs.cache_lengths + new,
            lookup_table=inputs.lookup_table,
            max_lengths=inputs.max_lengths[1:],
        )

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

    # -- validation (under the lock) --
    def _get(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"seq_id {seq_id!r} is not claimed (never claimed or released)")
        return seq

    def _check_batch(self, batch: Sequence[KVRequest]) -> list[SequenceState]:
        """The states of ``batch``'s sequences; raises on a bad size, id or empty tokens."""
        if not 1 <= len(batch) <= self.max_batch_size:
            raise BatchSizeError(
                f"batch of {len(batch)} sequences; expected 1..max_batch_size={self.max_batch_size}"
            )
        seqs = [self._get(req.seq_id) for req in batch]
        if len({seq.seq_id for seq in seqs}) != len(seqs):
            ids = [req.seq_id for req in batch]
            raise DuplicateSequenceError(f"batch repeats a seq_id: {ids}")
        for req, seq in zip(batch, seqs, strict=True):
            if len(req.tokens) == 0:
                raise SequenceLengthError(f"seq {seq.seq_id}: tokens is empty; a step needs at least one")
        return seqs

    def _check_fetch(self, batch: Sequence[KVRequest], num_steps: int) -> list[SequenceState]:
        """``_check_batch``, plus ``num_steps`` and room within ``max_seq_len``."""
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise InvalidParamsError(f"num_steps must be a positive int, got {num_steps!r}")
        seqs = self._check_batch(batch)
        for req, seq in zip(batch, seqs, strict=True):
            total = seq.start + len(req.tokens) + num_steps - 1
            if total > self.max_seq_len:
                raise SequenceLengthError(
                    f"seq {seq.seq_id}: {seq.start} cached + {len(req.tokens)} new + {num_steps - 1} "
                    f"more steps = {total} tokens, past max_seq_len={self.max_seq_len}"
                )
        return seqs
