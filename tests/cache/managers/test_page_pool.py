"""PagePool: allocation, ref counts, LRU eviction and the chained prefix-hash index."""

import pytest

from kvgraph.cache.managers.page_pool import ROOT_HASH, PagePool, page_hash


def _ids(pages):
    return [p.page_id for p in pages]


def _cache_chain(pool, tokens):
    """Allocate pages for ``tokens`` (whole pages), register them as one chain, free them last-first."""
    P = pool.page_size
    pages = pool.allocate(len(tokens) // P)
    parent = ROOT_HASH
    for i, page in enumerate(pages):
        parent = pool.register(page, parent, tokens[i * P : (i + 1) * P])
    pool.free(reversed(pages))
    return pages


def test_allocate_and_free_track_ref_counts():
    pool = PagePool(4, page_size=2)
    a, b = pool.allocate(2)
    assert (a.ref_count, b.ref_count) == (1, 1) and pool.num_free == 2
    pool.touch([a])
    pool.free([a])
    assert a.ref_count == 1 and pool.num_free == 2
    pool.free([a, b])
    assert pool.num_free == 4
    with pytest.raises(AssertionError, match="no holder"):
        pool.free([a])


def test_unhashed_pages_are_reused_before_cached_ones():
    pool = PagePool(4, page_size=2)
    cached = _cache_chain(pool, [1, 2, 3, 4])
    plain = pool.allocate(2)
    assert set(_ids(plain)).isdisjoint(_ids(cached))
    pool.free(plain)
    again = pool.allocate(2)
    assert set(_ids(again)) == set(_ids(plain))
    assert pool.num_cached == 2


def test_eviction_is_least_recently_freed_first_and_chain_tails_go_first():
    pool = PagePool(4, page_size=2)
    old = _cache_chain(pool, [1, 2, 3, 4])  # freed first
    new = _cache_chain(pool, [5, 6, 7, 8])
    assert pool.num_free == 4 and pool.num_cached == 4
    (first,) = pool.allocate(1)
    assert first is old[1]  # tail of the oldest chain
    assert pool.match([1, 2, 3, 4, 9], 4).pages == [old[0]]
    (second,) = pool.allocate(1)
    assert second is old[0]
    assert pool.match([1, 2, 3, 4, 9], 4).pages == []
    assert _ids(pool.match([5, 6, 7, 8, 9], 4).pages) == _ids(new)


def test_touch_takes_cached_page_off_the_free_queue():
    pool = PagePool(3, page_size=2)
    (page,) = _cache_chain(pool, [1, 2])
    pool.touch([page])
    assert page.ref_count == 1 and pool.num_free == 2
    assert page not in pool.allocate(2)
    assert pool.match([1, 2, 3], 2).pages == [page]


def test_register_sets_a_hash_once_and_keeps_one_page_per_hash():
    pool = PagePool(3, page_size=2)
    a, b = pool.allocate(2)
    h = pool.register(a, ROOT_HASH, [1, 2])
    assert h == page_hash(ROOT_HASH, [1, 2]) and a.block_hash == h
    assert pool.register(b, ROOT_HASH, [1, 2]) == h
    assert b.block_hash is None and pool.num_cached == 1
    with pytest.raises(AssertionError, match="set once"):
        pool.register(a, ROOT_HASH, [1, 2])


def test_hashes_chain_through_the_parent():
    assert page_hash(ROOT_HASH, [3, 4]) != page_hash(page_hash(ROOT_HASH, [1, 2]), [3, 4])
    pool = PagePool(4, page_size=2)
    _cache_chain(pool, [1, 2, 3, 4])
    m = pool.match([9, 9, 3, 4, 5], 4)  # same second page after another first page
    assert m.pages == [] and m.partial is None
    assert len(pool.match([1, 2, 3, 4, 5], 4).pages) == 2


def test_match_respects_the_limit():
    pool = PagePool(4, page_size=2)
    pages = _cache_chain(pool, [1, 2, 3, 4])
    m = pool.match([1, 2, 3, 4], 3)
    assert m.pages == pages[:1]
    assert m.partial is pages[1] and m.partial_len == 1 and m.num_tokens(2) == 3
    assert pool.match([1, 2, 3, 4], 0).num_tokens(2) == 0


def test_partial_match_picks_the_longest_common_prefix():
    pool = PagePool(6, page_size=4)
    _cache_chain(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    _cache_chain(pool, [1, 2, 3, 4, 5, 6, 0, 0])
    m = pool.match([1, 2, 3, 4, 5, 6, 7, 9, 9], 8)
    assert len(m.pages) == 1 and m.partial_len == 3 and m.partial.tokens == (5, 6, 7, 8)
    assert pool.match([1, 2, 3, 4, 8, 8], 5).partial is None


def test_eviction_forgets_hash_and_partial_candidates():
    pool = PagePool(1, page_size=2)
    (page,) = _cache_chain(pool, [1, 2])
    assert pool.match([1, 2, 3], 1).partial is page
    (again,) = pool.allocate(1)
    assert again is page and page.block_hash is None and pool.num_cached == 0
    assert pool.match([1, 2, 3], 2).num_tokens(2) == 0


def test_forget_free_drops_the_hashes_of_free_pages_and_keeps_held_ones():
    pool = PagePool(6, page_size=2)
    _cache_chain(pool, [1, 2, 3, 4])  # two free cached pages
    held = pool.allocate(1)[0]
    pool.register(held, ROOT_HASH, [7, 8])
    assert pool.num_cached == 3 and pool.match([1, 2, 3, 4, 5], limit=5).num_tokens(2) == 4
    assert pool.forget_free() == 2
    assert pool.num_cached == 1 and pool.num_free == 5
    assert pool.match([1, 2, 3, 4, 5], limit=5).num_tokens(2) == 0
    assert pool.match([7, 8, 9], limit=3).pages == [held]
    assert pool.forget_free() == 0
