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
from dataclasses import dataclass, replace

import torch

from kvgraph.cache import pool_memory
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.params import KVCacheParams, check_positive_int
from kvgraph.cache.request import KVRequest
from kvgraph.cache.symbols import (
    INDEX_DTYPE,
    RaggedKVCacheInputSymbols,
    ragged_input_symbols,
)
from kvgraph.errors import (
    BatchSizeError,
    BatchTypeError,
    CacheInputError,
    DuplicateSequenceError,
    InvalidParamsError,
    NoFreeSlotsError,
    SequenceLengthError,
    StepError,
    UnknownSequenceError,
)


def check_memory(available_cache_memory: object) -> int:
    """``available_cache_memory`` if it is a non-negative int (bytes), else ``InvalidParamsError``."""
    value = available_cache_memory
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidParamsError(f"available_cache_memory must be a non-negative int, got {value!r}")
    return value


def check_layers_and_devices(
    params: KVCacheParams, num_layers: object, devices: object
) -> list[torch.device]:
    """The devices of a cache with ``params`` (MAX's ``num_layers`` and ``devices`` arguments).

    ``num_layers`` (``None``: ``params.num_layers``) must equal ``params.num_layers``.
    ``devices`` is a list of ``params.n_devices`` torch devices (or device strings); ``None``
    means ``[params.device]`` for a one-device cache. Raises ``InvalidParamsError`` otherwise.
    """
    if num_layers is not None and num_layers != params.num_layers:
        raise InvalidParamsError(
            f"num_layers={num_layers!r} disagrees with params.num_layers={params.num_layers}"
        )
    if devices is None:
        if params.n_devices != 1:
            raise InvalidParamsError(
                f"params.n_devices={params.n_devices} needs devices: a list of {params.n_devices} devices"
            )
        return [torch.device(params.device)]
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise InvalidParamsError(f"devices must be a list of torch devices, got {devices!r}")
    if len(devices) != params.n_devices:
        raise InvalidParamsError(
            f"devices lists {len(devices)} device(s), but params.n_devices={params.n_devices}"
        )
    try:
        return [torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as e:
        raise InvalidParamsError(f"devices must be a list of torch devices, got {devices!r}: {e}") from None


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
    """Whether ``step`` has committed tokens; until then the first fetch may hit the prefix cache."""


class KVCacheManager(abc.ABC):
    """Owns the cache blocks and the per-sequence bookkeeping.

    Built as MAX's: ``Manager(params, max_batch_size, max_seq_len, num_layers, devices, session)``;
    ``num_layers`` and ``devices`` may be left out (they default to ``params``'), ``session`` is
    accepted and ignored (PyTorch has no inference session object).

    Lifecycle of a sequence (as MAX): ``claim`` -> (``fetch`` -> run graph -> ``step``)* -> ``release``.
    Sequence ids are the cache's slots, ``0 .. max_batch_size - 1``: ``claim`` hands out the
    lowest free ones, ``release`` returns them to ``slots_remaining``. Every public method is
    atomic under ``self._lock``. A caller's mistake raises a ``KVCacheError`` subclass and leaves
    the manager unchanged.

    Attributes:
        devices: one torch device per shard of the heads (``params.n_devices``); ``params.device``
            is ``devices[0]``.
        device_blocks: one cache tensor per device (layout per strategy, see
            ``ragged_input_symbols``), each with ``params.n_kv_heads_per_device`` heads;
            ``fetch`` returns them as they are, the attention op writes into them.
        blocks: ``device_blocks[0]``.
        device_scales: for a quantized cache (``params.quantized``) the float32 scales of each
            device's blocks, laid out like them with the last dim ``params.scales_per_head``;
            empty otherwise.
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
        self.devices = check_layers_and_devices(params, num_layers, devices)
        if self.devices[0] != params.device:
            params = replace(params, device=self.devices[0])
        self.params = params
        self.max_batch_size = check_positive_int("max_batch_size", max_batch_size)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self._lock = threading.RLock()
        self._seqs: dict[int, SequenceState] = {}
        self.device_blocks: list[torch.Tensor] = []
        self.device_scales: list[torch.Tensor] = []

    @property
    def blocks(self) -> torch.Tensor:
        return self.device_blocks[0]

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """``device_scales[0]``, or ``None`` for an unquantized cache."""
        return self.device_scales[0] if self.device_scales else None

    def _allocate_blocks(self, num_blocks: int, rows: int) -> None:
        """Zeroed ``[num_blocks, 2, num_layers, rows, n_kv_heads_per_device, head_dim]`` per device, and
        for a quantized cache zeroed scales ``[..., scales_per_head]`` beside them."""
        p = self.params
        shape = (num_blocks, 2, p.num_layers, rows, p.n_kv_heads_per_device, p.head_dim)
        per_device = p.bytes_per_token // p.n_devices * num_blocks * rows  # K/V and their scales
        pool_memory.check_fits(per_device * sum(1 for d in self.devices if torch.device(d).type == "cpu"))
        self.device_blocks = [pool_memory.zeros(shape, p.dtype, d) for d in self.devices]
        if p.quantized:
            scale_shape = (*shape[:-1], p.scales_per_head)
            dtype = p.kvcache_quant_config.scale_dtype
            self.device_scales = [pool_memory.zeros(scale_shape, dtype, d) for d in self.devices]

    def _scales_of(self, device_index: int) -> torch.Tensor | None:
        return self.device_scales[device_index] if self.device_scales else None

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
        """Claim the ``n`` lowest free slots as sequence ids (``NoFreeSlotsError`` past
        ``slots_remaining``)."""
        with self._lock:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise BatchSizeError(f"claim needs a non-negative int count, got {n!r}")
            free = self._free_slots()
            if n > len(free):
                raise NoFreeSlotsError(
                    f"claim({n}) exceeds the {len(free)} free slot(s) (max_batch_size={self.max_batch_size})"
                )
            ids = free[:n]
            for seq_id in ids:
                self._seqs[seq_id] = self._new_sequence(seq_id)
            return ids

    def external_claim(self, seq_ids: Sequence[int]) -> None:
        """Claim the slots ``seq_ids`` chosen by the caller.

        Raises before claiming any: ``InvalidParamsError`` for an id that is not an int,
        ``NoFreeSlotsError`` for one outside ``0 .. max_batch_size - 1``,
        ``DuplicateSequenceError`` for one already claimed or repeated.
        """
        with self._lock:
            if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
                raise BatchTypeError(f"external_claim takes a list of int seq_ids, got {seq_ids!r}")
            ids = list(seq_ids)
            for seq_id in ids:
                if not isinstance(seq_id, int) or isinstance(seq_id, bool):
                    raise InvalidParamsError(f"seq_id must be an int slot, got {seq_id!r}")
                if not 0 <= seq_id < self.max_batch_size:
                    raise NoFreeSlotsError(
                        f"seq_id {seq_id} is not a slot of this cache: slots are 0..{self.max_batch_size - 1} "
                        f"(max_batch_size={self.max_batch_size})"
                    )
                if seq_id in self._seqs:
                    raise DuplicateSequenceError(f"seq_id {seq_id} is already claimed")
            if len(set(ids)) != len(ids):
                raise DuplicateSequenceError(f"seq_ids {ids} repeat an id")
            for seq_id in ids:
                self._seqs[seq_id] = self._new_sequence(seq_id)

    def _free_slots(self) -> list[int]:
        return [i for i in range(self.max_batch_size) if i not in self._seqs]

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
    def slots_remaining(self) -> set[int]:
        """The free slots: the sequence ids ``claim`` can still hand out."""
        with self._lock:
            return set(self._free_slots())

    @property
    def num_claimed(self) -> int:
        """How many sequences are claimed (``max_batch_size - len(slots_remaining)``)."""
        with self._lock:
            return len(self._seqs)

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

    @property
    def cached_prefix_tokens(self) -> int:
        """Tokens a prefix cache can serve; always 0 without one."""
        return 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no sequence holds; returns the pages forgotten (always 0
        without a prefix cache)."""
        return 0

    # -- steps --
    def can_fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> bool:
        """Whether ``fetch(batch, num_steps)`` would find enough cache; caller mistakes still raise."""
        with self._lock:
            seqs = self._check_fetch(batch, num_steps)
            return self._fits(batch, seqs, num_steps)

    def fetch(self, batch: Sequence[KVRequest], num_steps: int = 1) -> list[RaggedKVCacheInputs]:
        """Reserve cache for ``num_steps`` steps of ``batch`` and return the graph inputs, one per device.

        Each sequence gets room for ``len(req.new_tokens) + num_steps - 1`` more tokens. Sets
        ``req.cached_tokens`` (a prefix-cache hit on a sequence's first fetch, else 0). A sequence
        whose previous fetch was not followed by ``step`` raises ``StepError``: the tokens that
        fetch wrote would otherwise be lost.

        Returns per device a ``RaggedKVCacheInputs``: ``blocks`` (that device's tensor),
        ``cache_lengths int32 [batch]``, ``lookup_table int32``, ``max_lengths int32
        [num_steps, 2]`` (CPU) and, for a quantized cache, ``kv_scales`` (that device's scales).
        """
        with self._lock:
            seqs = self._check_fetch(batch, num_steps)
            self._reserve(batch, seqs, num_steps)
            new_counts = [len(req.tokens) - req.cached_tokens for req in batch]
            lengths = [seq.length for seq in seqs]
            cache_lengths = torch.tensor(lengths, dtype=INDEX_DTYPE)
            lookup_table = self._lookup_table(seqs)
            max_lengths = max_lengths_tensor(
                new_counts, [c + n for c, n in zip(lengths, new_counts, strict=True)], num_steps
            )
            return [
                RaggedKVCacheInputs(
                    blocks=blocks,
                    cache_lengths=cache_lengths.to(blocks.device),
                    lookup_table=lookup_table.to(blocks.device),
                    max_lengths=max_lengths,
                    kv_scales=self._scales_of(i),
                )
                for i, blocks in enumerate(self.device_blocks)
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
        return [ragged_input_symbols(self.params, device) for device in self.devices]

    def num_kv_inputs(self) -> int:
        """Number of KV tensors a graph takes per device."""
        return len(self.input_symbols()[0])

    def increment_cache_lengths(
        self, kv_cache_inputs: Sequence[RaggedKVCacheInputs], prev_model_inputs: object
    ) -> list[RaggedKVCacheInputs]:
        """Inputs for the next step of a multistep run, without a host sync and without touching
        the manager's own lengths: ``cache_lengths += new tokens of the previous step`` and
        ``max_lengths`` loses its first row.

        ``prev_model_inputs`` is the previous step's model inputs: any object with an
        ``input_row_offsets`` attribute (``int32 [batch + 1]``), or that tensor itself.
        """
        offsets = getattr(prev_model_inputs, "input_row_offsets", prev_model_inputs)
        if not isinstance(offsets, torch.Tensor):
            raise CacheInputError(
                f"prev_model_inputs must carry input_row_offsets (an int32 [batch + 1] tensor), "
                f"got {type(prev_model_inputs).__name__}"
            )
        with self._lock:
            return [self._increment(inputs, offsets) for inputs in kv_cache_inputs]

    @staticmethod
    def _increment(inputs: RaggedKVCacheInputs, input_row_offsets: torch.Tensor) -> RaggedKVCacheInputs:
        """``increment_cache_lengths`` of one device's inputs."""
        batch = inputs.cache_lengths.shape[0]
        if input_row_offsets.dim() != 1 or input_row_offsets.shape[0] != batch + 1:
            raise CacheInputError(
                f"input_row_offsets has shape {tuple(input_row_offsets.shape)}, expected ({batch + 1},)"
            )
        if inputs.max_lengths.shape[0] < 2:
            raise CacheInputError(
                f"max_lengths has {inputs.max_lengths.shape[0]} row(s): no step remains to increment to"
            )
        # offs: [batch + 1] -> new tokens per sequence: [batch]
        offs = input_row_offsets.to(inputs.cache_lengths.device, non_blocking=True)
        new = (offs[1:] - offs[:-1]).to(INDEX_DTYPE)
        return RaggedKVCacheInputs(
            blocks=inputs.blocks,
            cache_lengths=inputs.cache_lengths + new,
            lookup_table=inputs.lookup_table,
            max_lengths=inputs.max_lengths[1:],
            kv_scales=inputs.kv_scales,
        )

    # -- sizing (MAX's signatures; ``available_cache_memory`` is bytes over all ``devices``) --
    @classmethod
    @abc.abstractmethod
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
        """Bytes the cache blocks of such a manager take over all its devices."""

    @classmethod
    @abc.abstractmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParams,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[torch.device | str] | None = None,
        **kwargs: object,
    ) -> int:
        """The largest batch whose cache fits ``available_cache_memory`` (split evenly over ``devices``)."""

    # -- validation (under the lock) --
    def _get(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"seq_id {seq_id!r} is not claimed (never claimed or released)")
        return seq

    def _check_batch(self, batch: Sequence[KVRequest]) -> list[SequenceState]:
        """The states of ``batch``'s sequences; raises on a bad type, size, id or empty tokens."""
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence):
            raise BatchTypeError(f"a batch is a list of KVRequest, got {type(batch).__name__} {batch!r}")
        for i, req in enumerate(batch):
            if not isinstance(req, KVRequest):
                raise BatchTypeError(
                    f"batch[{i}] is {type(req).__name__} {req!r}; expected a KVRequest(seq_id, tokens)"
                )
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
        for seq in seqs:  # before any length: a batch with a pending sequence is a misuse whatever else
            if seq.reserved is not None:
                raise StepError(
                    f"seq {seq.seq_id} was fetched and not stepped: call step() with its request to "
                    f"commit the tokens that fetch wrote (or release it) before fetching it again"
                )
        for req, seq in zip(batch, seqs, strict=True):
            total = seq.length + len(req.tokens) + num_steps - 1
            if total > self.max_seq_len:
                raise SequenceLengthError(
                    f"seq {seq.seq_id}: {seq.length} cached + {len(req.tokens)} new + {num_steps - 1} "
                    f"more steps = {total} tokens, past max_seq_len={self.max_seq_len}"
                )
        return seqs
