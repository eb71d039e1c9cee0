"""Paged KV cache: fixed-size pages from a shared pool, with optional prefix caching (MAX's
``PagedKVCacheManager``). The request-level layer on top of ``PagePool``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvgraph.cache.managers.base import (
    KVCacheManager,
    SequenceState,
    check_layers_and_devices,
    check_memory,
)
from kvgraph.cache.managers.page_pool import ROOT_HASH, PagePool, PrefixMatch
from kvgraph.cache.managers.page_queue import Page
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy, check_positive_int
from kvgraph.cache.request import KVRequest
from kvgraph.cache.symbols import INDEX_DTYPE
from kvgraph.errors import InvalidParamsError, OutOfPagesError


@dataclass
class PagedSequence(SequenceState):
    """A sequence and the pages that hold its cache."""

    pages: list[Page] = field(default_factory=list)
    """``logical_page -> Page``: enough pages for ``reserved`` (or ``length``) tokens."""
    tokens: list[int] = field(default_factory=list)
    """Token ids in the cache (kept only with prefix caching, to hash full pages)."""
    hashes: list[bytes] = field(default_factory=list)
    """Chain hash of each full page of ``tokens`` (prefix caching)."""


@dataclass
class _Plan:
    """What ``fetch`` will do to one sequence; computed without changing anything."""

    req: KVRequest
    seq: PagedSequence
    reserved: int
    drop: list[Page]
    """Pages the sequence gives back, last-first."""
    keep: list[Page]
    match: PrefixMatch
    num_alloc: int
    fresh: bool
    """The sequence was never stepped: its first fetch, which may hit the prefix cache."""


def copy_page_rows(blocks: torch.Tensor, src: int, dst: int, n: int, scales: torch.Tensor | None = None) -> None:
    """Copy the first ``n`` token rows of every layer's K and V of page ``src`` into page ``dst``,
    and their scales for a quantized cache.

    ``blocks``: ``[num_pages, 2, L, page_size, H, D]`` (one device's heads); ``scales``: float32
    ``[num_pages, 2, L, page_size, H, D // group]`` or ``None``.
    """
    blocks[dst, :, :, :n].copy_(blocks[src, :, :, :n])
    if scales is not None:
        scales[dst, :, :, :n].copy_(scales[src, :, :, :n])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCacheManager(KVCacheManager):
    """Sequences hold pages of ``params.page_size`` tokens from one pool of ``total_pages``.

    ``blocks``: ``[total_num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]``
    of ``params.dtype`` per device, zero-initialised (axis 1: 0 = key, 1 = value); every device
    holds its heads of the same pages. A quantized cache keeps their scales in ``device_scales``
    (``page_bytes`` counts them), copied with the rows on copy-on-write. ``lookup_table``: ``int32 [batch, max_num_pages]``:
    ``[batch, logical_page] -> physical_page``, unused entries hold ``total_num_pages``.

    Built as MAX's ``(params, max_batch_size, max_seq_len, num_layers, devices, session,
    cache_memory)``. Give the pool size as exactly one of ``cache_memory`` (bytes over all
    devices: each device's equal share is rounded down to whole pages) or ``num_pages``. With ``params.enable_prefix_caching``,
    ``step`` registers every completed full page, and a sequence's first ``fetch`` reuses the
    cached pages that match the start of its tokens (``req.cached_tokens``). The match looks at
    ``req.tokens`` only: ``req.prompt`` could not add to it, since the hit stays below
    ``len(req.tokens)`` so that the step computes at least one token.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int | None = None,
        devices: Sequence[torch.device | str] | None = None,
        session: object | None = None,
        cache_memory: int | None = None,
        *,
        num_pages: int | None = None,
    ) -> None:
        if params.cache_strategy is not KVCacheStrategy.PAGED:
            raise InvalidParamsError(
                f"PagedKVCacheManager needs cache_strategy=paged, got {params.cache_strategy.value}"
            )
        if (num_pages is None) == (cache_memory is None):
            raise InvalidParamsError(
                f"give exactly one of num_pages or cache_memory, got num_pages={num_pages!r}, "
                f"cache_memory={cache_memory!r}"
            )
        if cache_memory is not None:
            check_positive_int("cache_memory", cache_memory)
            num_pages = self._pages_in(params, cache_memory)
            if num_pages == 0:
                raise InvalidParamsError(
                    f"cache_memory={cache_memory} bytes holds no page of page_bytes={params.page_bytes}"
                )
        check_positive_int("num_pages", num_pages)
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices, session)
        self.page_size: int = params.page_size
        self._pool = PagePool(num_pages, self.page_size)
        self._allocate_blocks(num_pages, self.page_size)
        self._prefix_caching = params.enable_prefix_caching
        self._prompt_tokens = 0  # tokens of first steps looked up in the prefix cache
        self._cached_prompt_tokens = 0  # of those, tokens served from it
        # prefix matches while the pool stays as it is: a scheduler asks can_fetch for a growing
        # batch, which plans every first fetch in it again; cleared whenever the pool changes
        self._matches: dict[tuple[int, ...], PrefixMatch] = {}
        self.copy_listeners: list[Callable[[int, int, int], None]] = []
        """Called with ``(src_page, dst_page, rows)`` after each copy-on-write, so that blocks this
        manager does not own (another process's shard of the heads) can repeat it."""

    # -- pool figures --
    @property
    def total_pages(self) -> int:
        return self._pool.num_pages

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds (including freed pages that still cache a prefix)."""
        with self._lock:
            return self._pool.num_free

    @property
    def used_pages_pct(self) -> float:
        """Fraction of pages held by sequences, in ``[0, 1]``."""
        with self._lock:
            return 1.0 - self._pool.num_free / self._pool.num_pages

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0.0 before any)."""
        with self._lock:
            return self._cached_prompt_tokens / self._prompt_tokens if self._prompt_tokens else 0.0

    def cached_prefix_length(self, tokens: Sequence[int]) -> int:
        with self._lock:
            return self._match(tokens).num_tokens(self.page_size)

    @property
    def cached_prefix_tokens(self) -> int:
        """Tokens the prefix cache can serve: its full pages (held or free) times ``page_size``."""
        with self._lock:
            return self._pool.num_cached * self.page_size

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no sequence holds (as vLLM's ``reset_prefix_cache``), so that
        the next prompts are computed whatever ran before; returns the pages forgotten. The pages
        stay free; held pages and their sequences are untouched."""
        with self._lock:
            self._matches.clear()
            return self._pool.forget_free()

    def pages_of(self, seq_id: int) -> list[int]:
        """``logical_page -> physical_page`` of ``seq_id``."""
        with self._lock:
            return [page.page_id for page in self._get(seq_id).pages]

    # -- strategy hooks --
    def _new_sequence(self, seq_id: int) -> PagedSequence:
        return PagedSequence(seq_id)

    def _free_sequence(self, seq: PagedSequence) -> None:
        self._matches.clear()
        self._pool.free(reversed(seq.pages))
        seq.pages = []

    def _fits(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> bool:
        return self._pages_short(self._plan(batch, seqs, num_steps)) == 0

    def _reserve(self, batch: Sequence[KVRequest], seqs: list[SequenceState], num_steps: int) -> None:
        plans = self._plan(batch, seqs, num_steps)
        short = self._pages_short(plans)
        if short:
            need = sum(p.num_alloc for p in plans)
            raise OutOfPagesError(
                f"batch of {len(plans)} needs {need} new pages; {short} more than the pool can give "
                f"({self._pool.num_free} free of {self._pool.num_pages}, page_size={self.page_size})"
            )
        self._matches.clear()
        pool = self._pool
        for p in plans:
            pool.free(p.drop)
        for p in plans:
            pool.touch(p.match.pages)
            if p.match.partial is not None:
                pool.touch([p.match.partial])
        for p in plans:
            new = pool.allocate(p.num_alloc)
            if p.match.partial is not None:
                self._copy_rows(p.match.partial, new[0], p.match.partial_len)
            p.seq.pages = p.keep + p.match.pages + new
        for p in plans:
            if p.match.partial is not None:
                pool.free([p.match.partial])
        for p in plans:
            seq, hit = p.seq, p.match.num_tokens(self.page_size)
            if p.fresh:
                seq.length = hit
                seq.tokens = [int(t) for t in p.req.tokens[:hit]] if self._prefix_caching else []
                seq.hashes = list(p.match.hashes)
                if self._prefix_caching:
                    self._prompt_tokens += len(p.req.tokens)
                    self._cached_prompt_tokens += hit
            seq.reserved = p.reserved
            seq.hit = hit
            p.req.cached_tokens = hit

    def _lookup_table(self, seqs: list[PagedSequence]) -> torch.Tensor:
        # lookup_table: [batch, logical_page] -> physical_page, unused = total_num_pages
        width = max(len(seq.pages) for seq in seqs)
        pad = self._pool.num_pages
        rows = [[page.page_id for page in seq.pages] + [pad] * (width - len(seq.pages)) for seq in seqs]
        return torch.tensor(rows, dtype=INDEX_DTYPE)

    def _commit(self, seq: PagedSequence, req: KVRequest) -> None:
        if not self._prefix_caching:
            return
        P = self.page_size
        seq.tokens.extend(int(t) for t in req.tokens[req.cached_tokens :])
        if len(seq.hashes) < len(seq.tokens) // P:
            self._matches.clear()
        while len(seq.hashes) < len(seq.tokens) // P:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            seq.hashes.append(self._pool.register(seq.pages[i], parent, seq.tokens[i * P : (i + 1) * P]))

    # -- planning --
    def _plan(self, batch: Sequence[KVRequest], seqs: list[PagedSequence], num_steps: int) -> list[_Plan]:
        plans = []
        for req, seq in zip(batch, seqs, strict=True):
            reserved = seq.length + len(req.tokens) + num_steps - 1
            num_pages = _ceil_div(reserved, self.page_size)
            if seq.stepped:
                match = PrefixMatch()
                keep, drop = seq.pages[:num_pages], seq.pages[num_pages:][::-1]
                num_alloc = max(0, num_pages - len(seq.pages))
            else:  # a first fetch: the sequence holds no page yet
                match = self._match(req.tokens) if req.reuse_prefix else PrefixMatch()
                keep, drop = [], []
                num_alloc = num_pages - len(match.pages)
            plans.append(_Plan(req, seq, reserved, drop, keep, match, num_alloc, not seq.stepped))
        return plans

    def _match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Cached pages for a first fetch of ``tokens``; the last token is always computed."""
        if not self._prefix_caching or len(tokens) < 2:
            return PrefixMatch()
        limit = len(tokens) - 1
        key = tuple(map(int, tokens[:limit]))
        match = self._matches.get(key)
        if match is None:
            match = self._matches[key] = self._pool.match(key, limit)
        return match

    def _pages_short(self, plans: list[_Plan]) -> int:
        """How many pages the pool lacks to carry out ``plans`` (0: they fit).

        Replays the ref-count changes in the order ``_reserve`` makes them: drops, then
        touches of matched pages (a free cached page stops being free), then allocations.
        """
        refs: dict[int, int] = {}
        free = self._pool.num_free
        for p in plans:
            for page in p.drop:
                refs[page.page_id] = refs.get(page.page_id, page.ref_count) - 1
                free += refs[page.page_id] == 0
        for p in plans:
            shared = p.match.pages + ([p.match.partial] if p.match.partial is not None else [])
            for page in shared:
                r = refs.get(page.page_id, page.ref_count)
                free -= r == 0
                refs[page.page_id] = r + 1
        free -= sum(p.num_alloc for p in plans)
        return max(0, -free)

    def _copy_rows(self, src: Page, dst: Page, n: int) -> None:
        """Copy-on-write: the first ``n`` token rows of every layer's K and V (and their scales) from
        ``src`` to ``dst``."""
        for i, blocks in enumerate(self.device_blocks):
            copy_page_rows(blocks, src.page_id, dst.page_id, n, self._scales_of(i))
        for listener in self.copy_listeners:
            listener(src.page_id, dst.page_id, n)

    # -- sizing --
    @staticmethod
    def _pages_in(params: KVCacheParams, cache_memory: int) -> int:
        """Whole pages in ``cache_memory`` bytes split evenly over ``params.n_devices`` devices."""
        return cache_memory // params.n_devices // (params.page_bytes // params.n_devices)

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
        """Bytes (over all devices) of a pool that holds ``max_batch_size`` sequences of
        ``max_seq_len`` tokens, capped at the whole pages ``available_cache_memory`` holds."""
        check_layers_and_devices(params, num_layers, devices)
        check_positive_int("max_batch_size", max_batch_size)
        need = max_batch_size * cls._pages_per_sequence(params, max_seq_len)
        return min(need, cls._pages_in(params, check_memory(available_cache_memory))) * params.page_bytes

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
        """How many sequences of ``max_seq_len`` tokens (whole pages each) fit in the pages of
        ``available_cache_memory`` bytes (0 if none)."""
        check_layers_and_devices(params, num_layers, devices)
        pages = cls._pages_in(params, check_memory(available_cache_memory))
        return pages // cls._pages_per_sequence(params, max_seq_len)

    @staticmethod
    def _pages_per_sequence(params: KVCacheParams, max_seq_len: int) -> int:
        return _ceil_div(check_positive_int("max_seq_len", max_seq_len), params.page_size)

