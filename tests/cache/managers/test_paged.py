"""PagedKVCacheManager: pages, lookup tables, running out, prefix caching, copy-on-write."""

import pytest
import torch

from kvgraph import InvalidParamsError, KVRequest, OutOfPagesError
from kvgraph.cache.managers import PagedKVCacheManager
from tests.cache.kv_checks import (
    assert_same_state,
    cache_row,
    check_contents,
    check_invariants,
    continuous_params,
    marker,
    paged_params,
    snapshot,
    write_steps,
)
from tests.naming import raises_naming


def _prefill(m, seq_id, tokens, num_steps=1):
    """Fetch, write the markers of, and step ``tokens`` as ``seq_id``'s prompt; return the request."""
    req = KVRequest(seq_id, list(tokens))
    (x,) = m.fetch([req], num_steps)
    write_steps(m, x, [req.tokens], [req.cached_tokens], [len(req.new_tokens)])
    m.step([req])
    return req


def test_constructor_takes_exactly_one_pool_size():
    params = paged_params(page_size=4)
    with raises_naming(InvalidParamsError, "exactly one", "num_pages=None", "cache_memory=None"):
        PagedKVCacheManager(params, 2, 8)
    with pytest.raises(InvalidParamsError, match="exactly one"):
        PagedKVCacheManager(params, 2, 8, num_pages=4, cache_memory=10**6)
    with pytest.raises(InvalidParamsError, match=r"num_pages.*positive.*\b0\b"):
        PagedKVCacheManager(params, 2, 8, num_pages=0)
    with raises_naming(InvalidParamsError, f"cache_memory={params.page_bytes - 1}", f"page_bytes={params.page_bytes}"):
        PagedKVCacheManager(params, 2, 8, cache_memory=params.page_bytes - 1)
    with pytest.raises(InvalidParamsError, match="cache_strategy=paged"):
        PagedKVCacheManager(continuous_params(), 2, 8, num_pages=4)
    m = PagedKVCacheManager(params, 2, 8, cache_memory=3 * params.page_bytes + 5)
    assert m.total_pages == 3


def test_blocks_layout():
    params = paged_params(page_size=5, dtype=torch.bfloat16)
    m = PagedKVCacheManager(params, 2, 8, num_pages=7)
    assert m.blocks.shape == (7, 2, 2, 5, 2, 2) and m.blocks.dtype == torch.bfloat16
    assert not m.blocks.any()
    assert m.blocks.numel() * m.blocks.element_size() == 7 * params.page_bytes


def test_lookup_rows_point_at_the_sequences_pages_and_pad_with_total():
    m = PagedKVCacheManager(paged_params(page_size=4), 3, 32, num_pages=10)
    a, b = m.claim(2)
    ra, rb = KVRequest(a, list(range(9))), KVRequest(b, [1, 2])
    (x,) = m.fetch([ra, rb])
    assert x.lookup_table.shape == (2, 3)
    assert x.lookup_table[0].tolist() == m.pages_of(a) and len(m.pages_of(a)) == 3
    assert x.lookup_table[1].tolist() == m.pages_of(b) + [10, 10]
    assert len(set(m.pages_of(a)) | set(m.pages_of(b))) == 4
    m.step([ra, rb])
    (x,) = m.fetch([KVRequest(b, [3])], num_steps=3)  # 2 + 1 + 2 = 5 tokens -> 2 pages
    assert x.lookup_table.shape == (1, 2) and x.lookup_table[0].tolist() == m.pages_of(b)


def test_pages_grow_only_as_tokens_need_them():
    m = PagedKVCacheManager(paged_params(page_size=4), 1, 32, num_pages=8)
    (a,) = m.claim(1)
    _prefill(m, a, [1, 2, 3])
    first = m.pages_of(a)
    assert len(first) == 1 and m.free_pages == 7
    for t in range(4, 10):
        req = KVRequest(a, [t])
        m.fetch([req])
        m.step([req])
    assert m.pages_of(a)[:1] == first and len(m.pages_of(a)) == 3 and m.free_pages == 5


def test_refetch_gives_back_pages_it_no_longer_needs():
    m = PagedKVCacheManager(paged_params(page_size=4), 2, 32, num_pages=8)
    (a,) = m.claim(1)
    _prefill(m, a, [1, 2, 3, 4])
    m.fetch([r := KVRequest(a, [5])], num_steps=9)  # 4 + 1 + 8 = 13 tokens -> 4 pages
    assert len(m.pages_of(a)) == 4 and m.free_pages == 4
    m.step([r])  # the run stopped after one step: 5 tokens committed, 4 pages still held
    assert len(m.pages_of(a)) == 4 and m.cache_length(a) == 5
    m.fetch([KVRequest(a, [6])])  # 6 tokens -> 2 pages
    assert len(m.pages_of(a)) == 2 and m.free_pages == 6
    check_invariants(m)


def test_out_of_pages_after_can_fetch_false_leaves_state_unchanged():
    m = PagedKVCacheManager(paged_params(page_size=4), 3, 32, num_pages=4)
    a, b = m.claim(2)
    _prefill(m, a, list(range(10)))  # 3 pages
    batch = [KVRequest(b, list(range(8)))]  # 2 pages, 1 free
    assert not m.can_fetch(batch)
    before = snapshot(m)
    with raises_naming(OutOfPagesError, "2 new pages", "1 more", "1 free", "page_size=4"):

        m.fetch(batch)
    assert_same_state(before, snapshot(m))
    assert batch[0].cached_tokens == 0
    assert m.can_fetch([KVRequest(b, list(range(4)))])
    m.release(a)
    assert m.can_fetch(batch) and m.free_pages == 4


def test_used_pages_pct_and_free_pages():
    m = PagedKVCacheManager(paged_params(page_size=2), 2, 32, num_pages=8)
    assert m.used_pages_pct == 0.0 and m.free_pages == 8
    (a,) = m.claim(1)
    _prefill(m, a, [1, 2, 3])
    assert m.free_pages == 6 and m.used_pages_pct == pytest.approx(0.25)
    m.release(a)
    assert m.free_pages == 8 and m.used_pages_pct == 0.0


def test_memory_size_and_optimal_batch_count_whole_pages():
    params = paged_params(page_size=4)
    per_seq = 3 * params.page_bytes  # 10 tokens -> 3 pages
    L, devices = params.num_layers, [params.device]
    assert PagedKVCacheManager.estimated_memory_size(params, 5, 10, L, 10**12, devices) == 5 * per_seq
    assert PagedKVCacheManager.estimated_memory_size(params, 5, 10, L, 7 * params.page_bytes + 1, devices) == (
        7 * params.page_bytes
    )
    assert PagedKVCacheManager.infer_optimal_batch_size(params, 10, L, 4 * per_seq - 1, devices) == 3
    with pytest.raises(InvalidParamsError, match="max_seq_len"):
        PagedKVCacheManager.infer_optimal_batch_size(params, 0, L, per_seq, devices)


# -- prefix caching --


def _prefix_manager(num_pages=12, page_size=4, max_batch_size=4):
    params = paged_params(page_size=page_size, prefix=True)
    return PagedKVCacheManager(params, max_batch_size, 64, num_pages=num_pages)


def test_same_prompt_hits_full_pages_and_shares_them():
    m = _prefix_manager()
    a, b = m.claim(2)
    prompt = list(range(1, 11))  # 2 full pages + 2 tokens
    _prefill(m, a, prompt)
    req = KVRequest(b, prompt)
    (x,) = m.fetch([req])
    assert req.cached_tokens == 8
    assert x.cache_lengths.tolist() == [8] and x.max_lengths.tolist() == [[2, 10]]
    assert m.pages_of(b)[:2] == m.pages_of(a)[:2] and m.pages_of(b)[2] != m.pages_of(a)[2]
    assert m.cache_length(b) == 8
    write_steps(m, x, [prompt], [8], [2])
    m.step([req])
    check_contents(m, {a: prompt, b: prompt})
    check_invariants(m)
    assert m.cache_hit_rate == pytest.approx(8 / 20)


def test_hit_never_covers_the_last_token_and_copies_the_partial_page():
    m = _prefix_manager()
    a, b = m.claim(2)
    prompt = list(range(1, 9))  # exactly 2 full pages
    _prefill(m, a, prompt)
    shared = m.pages_of(a)
    original = m.blocks[shared[1]].clone()
    req = KVRequest(b, prompt)
    (x,) = m.fetch([req])
    assert req.cached_tokens == 7 and req.new_tokens == [8]
    own = m.pages_of(b)
    assert own[0] == shared[0] and own[1] != shared[1]
    # copy-on-write: the first 3 rows came from the shared page
    assert torch.equal(m.blocks[own[1], :, :, :3], m.blocks[shared[1], :, :, :3])
    write_steps(m, x, [prompt], [7], [1])
    cache_row(m, (own[1], 3)).fill_(-1.0)  # b writes its own copy ...
    assert torch.equal(m.blocks[shared[1]], original)  # ... and the shared page is untouched
    cache_row(m, (own[1], 3)).fill_(marker(prompt))
    m.step([req])
    check_contents(m, {a: prompt, b: prompt})
    check_invariants(m)


def test_diverging_prompt_copies_the_common_rows_of_a_partial_page():
    m = _prefix_manager()
    a, b = m.claim(2)
    _prefill(m, a, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    req = KVRequest(b, [1, 2, 3, 4, 5, 6, 0, 0, 0])
    m.fetch([req])
    assert req.cached_tokens == 6
    assert m.pages_of(b)[0] == m.pages_of(a)[0] and m.pages_of(b)[1] != m.pages_of(a)[1]
    check_contents(m, {b: [1, 2, 3, 4, 5, 6]})


def test_same_page_after_a_different_prefix_does_not_match():
    m = _prefix_manager()
    a, b = m.claim(2)
    _prefill(m, a, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    req = KVRequest(b, [0, 0, 0, 0, 5, 6, 7, 8, 9])
    m.fetch([req])
    assert req.cached_tokens == 0
    assert set(m.pages_of(a)).isdisjoint(m.pages_of(b))


def test_freed_cached_pages_serve_a_later_sequence():
    m = _prefix_manager()
    (a,) = m.claim(1)
    prompt = list(range(20, 33))
    _prefill(m, a, prompt)
    pages = m.pages_of(a)
    m.release(a)
    assert m.free_pages == m.total_pages
    (b,) = m.claim(1)
    req = KVRequest(b, prompt + [99])
    (x,) = m.fetch([req])
    assert req.cached_tokens == 12 and m.pages_of(b)[:3] == pages[:3]
    check_contents(m, {b: prompt[:12]})


def test_lru_eviction_drops_the_oldest_cached_prefix_first():
    m = _prefix_manager(num_pages=6)
    old_prompt, new_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0], [9, 9, 9, 9, 8, 8, 8, 8, 0]
    for prompt in (old_prompt, new_prompt):
        (s,) = m.claim(1)
        _prefill(m, s, prompt)
        m.release(s)
    (c,) = m.claim(1)
    _prefill(m, c, [5] * 9)  # 3 pages: two unhashed free pages and the old chain's tail
    m.release(c)
    probe_old, probe_new = m.claim(2)
    r_old, r_new = KVRequest(probe_old, old_prompt), KVRequest(probe_new, new_prompt)
    assert m.can_fetch([r_old, r_new])
    m.fetch([r_old, r_new])
    assert r_old.cached_tokens == 4 and r_new.cached_tokens == 8


def test_shared_prefix_fetch_in_one_batch_counts_pages_once():
    m = _prefix_manager(num_pages=5)
    a, b, c = m.claim(3)
    prompt = list(range(1, 10))  # 2 full pages + 1
    _prefill(m, a, prompt)
    m.release(a)
    batch = [KVRequest(b, prompt), KVRequest(c, prompt)]
    assert m.can_fetch(batch)  # 2 cached pages + 1 fresh page each
    m.fetch(batch)
    assert batch[0].cached_tokens == batch[1].cached_tokens == 8
    assert m.free_pages == 1
    check_invariants(m)


def test_cache_hit_rate_counts_a_hit_at_the_fetch_that_takes_it():
    m = _prefix_manager()
    a, b = m.claim(2)
    prompt = list(range(1, 10))
    _prefill(m, a, prompt)
    assert m.cache_hit_rate == 0.0
    m.fetch([KVRequest(b, prompt)])  # hits 8 of 9, before any step
    assert m.cache_hit_rate == pytest.approx(8 / 18)
    check_invariants(m)


def test_cache_hit_rate_counts_first_steps_only():
    m = _prefix_manager()
    assert m.cache_hit_rate == 0.0
    a, b = m.claim(2)
    _prefill(m, a, [1, 2, 3, 4, 5])
    _prefill(m, b, [1, 2, 3, 4, 6])
    r = KVRequest(b, [7])
    m.fetch([r])
    m.step([r])
    assert m.cache_hit_rate == pytest.approx(4 / 10)


def test_prefix_caching_off_never_hits():
    m = PagedKVCacheManager(paged_params(page_size=4), 2, 32, num_pages=8)
    a, b = m.claim(2)
    _prefill(m, a, list(range(9)))
    req = KVRequest(b, list(range(9)))
    m.fetch([req])
    assert req.cached_tokens == 0 and m.cache_hit_rate == 0.0


def test_cached_prefix_length_predicts_the_first_fetch_without_changing_state():
    m = _prefix_manager()
    a, b = m.claim(2)
    prompt = list(range(1, 12))
    _prefill(m, a, prompt)
    before = snapshot(m)
    assert m.cached_prefix_length(prompt) == 8
    assert m.cached_prefix_length(prompt[:8]) == 7  # the whole second page, less the last token
    assert m.cached_prefix_length([5]) == m.cached_prefix_length([0, 0, 0, 0, 0]) == 0
    assert_same_state(before, snapshot(m))
    req = KVRequest(b, prompt[:8])
    m.fetch([req])
    assert req.cached_tokens == 7
    plain = PagedKVCacheManager(paged_params(page_size=4), 2, 32, num_pages=8)
    assert plain.cached_prefix_length(prompt) == 0
