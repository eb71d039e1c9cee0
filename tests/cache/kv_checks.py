"""Test helpers for the managers: play the attention op's cache writes, read the cache back,
check invariants and snapshot state.

The value written for a token is a function of the whole prefix that ends at it (as a real
K/V projection is), so a page shared by prefix caching holds the same values for every
sequence that matches it, and a page mapped to the wrong sequence shows.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch

from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.cache.managers import (
    ContinuousBatchingKVCacheManager,
    KVCacheManager,
    PagedKVCacheManager,
)
from kvgraph.cache.params import KVCacheParams
from tests.naming import raises_naming


def paged_params(page_size: int = 4, prefix: bool = False, **kw) -> KVCacheParams:
    base = dict(dtype=torch.float32, n_kv_heads=2, head_dim=2, num_layers=2)
    return KVCacheParams(**{**base, **kw}, page_size=page_size, enable_prefix_caching=prefix)


def continuous_params(**kw) -> KVCacheParams:
    base = dict(dtype=torch.float32, n_kv_heads=2, head_dim=2, num_layers=2)
    return KVCacheParams(**{**base, **kw}, page_size=None, cache_strategy="continuous")


def marker(prefix: Sequence[int]) -> float:
    """A nonzero value, exact in float32, determined by the token ids of ``prefix``."""
    h = 7
    for t in prefix:
        h = (h * 1_000_003 + int(t) + 1) % 16_777_213
    return float(h + 1)


def cache_row(manager: KVCacheManager, where: tuple[int, int]) -> torch.Tensor:
    """``blocks`` row ``[2, L, H, D]`` at ``(page_or_slot, row)``."""
    index, row = where
    return manager.blocks[index, :, :, row]


def location(inputs: RaggedKVCacheInputs, b: int, pos: int, page_size: int | None) -> tuple[int, int]:
    """``(page_or_slot, row)`` of position ``pos`` of batch row ``b``, as the attention op finds it."""
    if inputs.is_paged:
        return int(inputs.lookup_table[b, pos // page_size]), pos % page_size
    return int(inputs.lookup_table[b]), pos


def seq_location(manager: KVCacheManager, seq_id: int, pos: int) -> tuple[int, int]:
    """``(page_or_slot, row)`` of position ``pos`` of ``seq_id`` from the manager's own books."""
    if isinstance(manager, PagedKVCacheManager):
        return manager.pages_of(seq_id)[pos // manager.page_size], pos % manager.page_size
    return seq_id, pos  # a continuous sequence's id is its slot


def write_steps(
    manager: KVCacheManager,
    inputs: RaggedKVCacheInputs,
    histories: Sequence[Sequence[int]],
    starts: Sequence[int],
    new_counts: Sequence[int],
    num_steps: int = 1,
) -> None:
    """Write what the attention op would for ``num_steps`` steps of a batch.

    Row ``b`` writes ``new_counts[b]`` tokens in step 1 and one per later step; the token at
    index ``starts[b] + k`` of ``histories[b]`` (the sequence's tokens from position 0)
    gets ``marker(histories[b][: index + 1])`` at the position ``inputs`` assign it.
    Later steps take their inputs from ``manager.increment_cache_lengths``.
    """
    page_size = getattr(manager, "page_size", None)
    counts = list(new_counts)
    done = [0] * len(counts)
    for step in range(num_steps):
        for b, n in enumerate(counts):
            lengths = inputs.cache_lengths
            for i in range(n):
                index = starts[b] + done[b] + i
                value = marker(histories[b][: index + 1])
                cache_row(manager, location(inputs, b, int(lengths[b]) + i, page_size)).fill_(value)
            done[b] += n
        if step + 1 < num_steps:
            offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
            (inputs,) = manager.increment_cache_lengths([inputs], offsets)
            counts = [1] * len(counts)


def check_contents(manager: KVCacheManager, shadow: dict[int, list[int]]) -> None:
    """Every live sequence's committed tokens still hold their markers."""
    for seq_id, tokens in shadow.items():
        for pos in range(len(tokens)):
            row = cache_row(manager, seq_location(manager, seq_id, pos))
            want = marker(tokens[: pos + 1])
            assert bool((row == want).all()), (
                f"seq {seq_id} position {pos}: cache holds {row.flatten()[:4].tolist()}, want {want}"
            )


def check_invariants(manager: KVCacheManager) -> None:
    """Bookkeeping invariants of either manager."""
    seqs = manager._seqs
    assert manager.slots_remaining == set(range(manager.max_batch_size)) - set(seqs)
    assert manager.num_claimed == len(seqs)
    for seq in seqs.values():
        assert seq.length <= manager.max_seq_len
        if seq.reserved is not None:
            assert seq.length <= seq.reserved <= manager.max_seq_len
    if isinstance(manager, ContinuousBatchingKVCacheManager):
        return
    pool, P = manager._pool, manager.page_size
    holders: dict[int, int] = {}
    for seq in seqs.values():
        ids = [page.page_id for page in seq.pages]
        assert len(set(ids)) == len(ids), f"seq {seq.seq_id} holds a page twice: {ids}"
        assert len(seq.pages) * P >= max(seq.length, seq.reserved or 0)
        for i, page in enumerate(seq.pages):
            holders[page.page_id] = holders.get(page.page_id, 0) + 1
            if page.ref_count > 1:  # only cached full pages inside the cached prefix are shared
                assert page.block_hash is not None and (i + 1) * P <= seq.length, (
                    f"page {page.page_id} is shared by {page.ref_count} but is not a cached full page "
                    f"of seq {seq.seq_id} (logical {i}, length {seq.length})"
                )
        if manager.params.enable_prefix_caching:
            assert len(seq.tokens) == seq.length
            assert len(seq.hashes) <= seq.length // P
    free_ids = [page.page_id for page in pool.free_queue]
    assert len(set(free_ids)) == len(free_ids) == pool.num_free
    for page in pool.pages:
        assert page.ref_count == holders.get(page.page_id, 0), (
            f"page {page.page_id}: ref_count {page.ref_count}, held by {holders.get(page.page_id, 0)}"
        )
        assert (page.ref_count == 0) == (page.page_id in set(free_ids))
        if page.block_hash is not None:
            assert pool._cached[page.block_hash] is page
            assert pool._children[page.parent_hash][page.page_id] is page
    used = sum(1 for page in pool.pages if page.ref_count > 0)
    assert manager.free_pages + used == manager.total_pages
    assert sum(len(c) for c in pool._children.values()) == pool.num_cached


def snapshot(manager: KVCacheManager) -> dict:
    """Everything a failed call must leave as it was: bookkeeping and cache contents."""
    state = {
        "seqs": copy.deepcopy({k: _seq_fields(s) for k, s in manager._seqs.items()}),
        "blocks": manager.blocks.clone(),
    }
    if isinstance(manager, PagedKVCacheManager):
        pool = manager._pool
        state["pages"] = [(p.ref_count, p.block_hash, p.parent_hash, p.tokens) for p in pool.pages]
        state["free"] = [page.page_id for page in pool.free_queue]
        state["cached"] = {h: p.page_id for h, p in pool._cached.items()}
        state["counters"] = (manager._prompt_tokens, manager._cached_prompt_tokens)
    return state


def raises_unchanged(
    manager: KVCacheManager, error: type[Exception], fn, *args, match=None, naming: Sequence[str] = (), **kwargs
):
    """Call ``fn``, expect ``error``, and check that ``manager`` is exactly as before.

    ``match`` is a regex the message must match; ``naming``, fragments it must name
    (see :func:`tests.naming.raises_naming`).
    """
    before = snapshot(manager)
    with raises_naming(error, *naming) if naming else pytest.raises(error, match=match):
        fn(*args, **kwargs)
    assert_same_state(before, snapshot(manager))


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "blocks":
            assert torch.equal(a[key], b[key]), "cache contents changed"
        else:
            assert a[key] == b[key], f"{key} changed: {a[key]} -> {b[key]}"


def _seq_fields(seq) -> dict:
    fields = dict(vars(seq))
    if "pages" in fields:
        fields["pages"] = [page.page_id for page in fields["pages"]]
    return fields


KINDS = ("continuous", "paged", "prefix")


def make_manager(
    kind: str, max_batch_size: int = 4, max_seq_len: int = 32, device: str = "cpu", **kw
) -> KVCacheManager:
    """A small manager of ``kind``: ``continuous``, ``paged`` or ``prefix`` (paged with prefix caching);
    ``kw`` (``num_pages``, ``page_size``) apply to the paged kinds."""
    if kind == "continuous":
        return ContinuousBatchingKVCacheManager(continuous_params(device=device), max_batch_size, max_seq_len)
    page_size = kw.pop("page_size", 4)
    kw.setdefault("num_pages", 16)
    params = paged_params(page_size, prefix=kind == "prefix", device=device)
    return PagedKVCacheManager(params, max_batch_size, max_seq_len, **kw)
