"""The scheduler against a real PagedKVCacheManager, with the model replaced by a fixed next token."""

import pytest
import torch

from kvgraph.cache.managers import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.engine.requests import EngineRequest, FinishReason, RequestStatus
from kvgraph.engine.sampling import SamplingParams
from kvgraph.engine.scheduler import Scheduler

NEXT = 7  # the token every "model call" produces


def _manager(num_pages=64, page_size=4, max_batch_size=8, max_seq_len=64, prefix=False):
    params = KVCacheParams(torch.float32, 1, 4, 1, page_size=page_size, enable_prefix_caching=prefix)
    return PagedKVCacheManager(params, max_batch_size, max_seq_len, num_pages=num_pages)


def _scheduler(manager, **kw):
    kw = {"max_batch_size": manager.max_batch_size, "max_batch_tokens": 64,
          "max_seq_len": manager.max_seq_len, **kw}
    return Scheduler(manager, **kw)


def _request(i, n_prompt, max_new=4, first=10):
    return EngineRequest(i, list(range(first, first + n_prompt)), SamplingParams(max_new_tokens=max_new))


def _step(s: Scheduler):
    """One engine step without a model: fetch, commit, append NEXT where a token is due."""
    out = s.schedule()
    if not out.entries:
        return out
    s.manager.fetch(out.kv_requests, num_steps=out.num_steps)
    due = [e for e in out.entries if e.completes_context]
    for e in out.entries:
        if out.num_steps > 1:
            e.kv.tokens = [*e.kv.tokens] + [NEXT] * (out.num_steps - 1)
    s.manager.step(out.kv_requests)
    for e in out.entries:
        e.request.num_computed += len(e.kv.tokens)
    for e in due:
        for _ in range(out.num_steps):
            e.request.output_ids.append(NEXT)
            reason = e.request.stop_reason(NEXT, s.max_seq_len)
            if reason is not None:
                s.finish(e.request, reason)
                break
    return out


def _run(s):
    outs = []
    while s.has_unfinished():
        outs.append(_step(s))
        assert len(outs) < 500
    return outs


def test_fcfs_and_the_token_budget_is_never_exceeded():
    s = _scheduler(_manager(), max_batch_tokens=10)
    reqs = [_request(i, 6, max_new=3) for i in range(4)]
    for r in reqs:
        s.add(r)
    outs = _run(s)
    for out in outs:
        assert sum(len(e.kv.tokens) for e in out.entries) <= 10
    admitted = [e.request.request_id for out in outs for e in out.entries if e.kv.prompt is not None]
    first_seen = list(dict.fromkeys(admitted))
    assert first_seen == [0, 1, 2, 3]
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 3 for r in reqs)


def test_decodes_go_first_and_prefills_fill_the_rest_of_the_budget():
    s = _scheduler(_manager(), max_batch_tokens=8)
    a, b = _request(0, 3), _request(1, 20)
    s.add(a)
    _step(s)  # a's prefill, a gets its first token
    s.add(b)
    out = _step(s)
    assert [e.request for e in out.entries] == [a, b]
    assert [len(e.kv.tokens) for e in out.entries] == [1, 7]  # decode, then a 7-token chunk of b
    assert not out.entries[1].completes_context


def test_a_long_prompt_is_chunked_and_samples_only_at_its_end():
    s = _scheduler(_manager(), max_batch_tokens=5)
    r = _request(0, 12, max_new=1)
    s.add(r)
    chunks = []
    while s.has_unfinished():
        out = _step(s)
        chunks.append([len(e.kv.tokens) for e in out.entries])
    assert chunks == [[5], [5], [2]]
    assert r.output_ids == [NEXT]


def test_preemption_releases_the_newest_request_and_requeues_it_first():
    m = _manager(num_pages=6, page_size=4)
    s = _scheduler(m)
    old, new, later = _request(0, 8, max_new=8), _request(1, 8, max_new=8), _request(2, 4, max_new=1)
    s.add(old)
    s.add(new)
    _step(s)  # both prefilled: 2 + 2 pages, first token each
    s.add(later)
    preempted = []
    while s.has_unfinished():
        out = _step(s)
        preempted += out.preempted
        if out.preempted:
            assert out.preempted[0] is new
            assert new.seq_id is None and new.num_computed == 0
            assert list(s.waiting)[:1] == [new]  # ahead of `later`
    assert new in preempted
    assert old.output_ids == new.output_ids == [NEXT] * 8
    assert m.free_pages == m.total_pages


def test_a_request_preempts_itself_when_it_is_the_newest():
    m = _manager(num_pages=4, page_size=4, max_seq_len=16)
    s = _scheduler(m)
    a, b = _request(0, 4, max_new=9), _request(1, 4, max_new=9)
    s.add(a)
    s.add(b)
    _run(s)
    assert s.num_preemptions > 0
    assert a.output_ids == b.output_ids == [NEXT] * 9
    assert m.free_pages == m.total_pages


def test_abort_frees_pages_at_once():
    m = _manager()
    s = _scheduler(m)
    r, other = _request(0, 9), _request(1, 5)
    s.add(r)
    s.add(other)
    _step(s)
    held = m.total_pages - m.free_pages
    s.finish(r, FinishReason.ABORT)
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.ABORT
    assert not m.contains(0) and r.seq_id is None
    assert m.total_pages - m.free_pages == held - 3  # r's 9 + 1 tokens took 3 pages of 4
    s.abort_all()
    assert m.free_pages == m.total_pages and not s.has_unfinished()


def test_waiting_requests_do_not_overtake_one_that_does_not_fit():
    m = _manager(num_pages=5, page_size=4)
    s = _scheduler(m)
    big, small_first, small = _request(0, 8), _request(1, 12), _request(2, 2)
    s.add(big)
    _step(s)  # big holds 3 pages (8 prompt + 1 token of room)
    s.add(small_first)  # needs 3 pages: does not fit next to big
    s.add(small)  # would fit, but must wait its turn
    out = _step(s)
    assert [e.request for e in out.entries] == [big]


def test_multistep_runs_decode_batches_capped_by_the_length_left():
    m = _manager()
    s = _scheduler(m, num_steps=4)
    a, b = _request(0, 3, max_new=6), _request(1, 5, max_new=3)
    s.add(a)
    s.add(b)
    steps = [out.num_steps for out in _run(s)]
    assert steps[0] == 1  # prefill
    assert steps[1] == 2  # b has 2 tokens left
    assert steps[2:] == [3]  # a alone, 3 left
    assert len(a.output_ids) == 6 and len(b.output_ids) == 3
    assert m.free_pages == m.total_pages


def test_continuous_manager_never_preempts():
    params = KVCacheParams(torch.float32, 1, 4, 1, page_size=None, cache_strategy="continuous")
    m = ContinuousBatchingKVCacheManager(params, 2, 32)
    s = _scheduler(m)
    reqs = [_request(i, 4, max_new=3) for i in range(5)]
    for r in reqs:
        s.add(r)
    outs = _run(s)
    assert max(len(o.entries) for o in outs) == 2  # two slots
    assert s.num_preemptions == 0
    assert all(len(r.output_ids) == 3 for r in reqs)
    assert len(m.slots_remaining) == 2


@pytest.mark.parametrize("max_seq_len", [8, 9])
def test_length_limit_of_the_cache_ends_a_request(max_seq_len):
    s = _scheduler(_manager(max_seq_len=max_seq_len))
    r = _request(0, 6, max_new=100)
    s.add(r)
    _run(s)
    assert r.finish_reason is FinishReason.LENGTH
    assert r.num_tokens == max_seq_len + 1  # the last token is returned, never cached


def test_a_prefix_hit_is_free_and_the_first_chunk_starts_after_it():
    m = _manager(page_size=4, prefix=True)
    s = _scheduler(m, max_batch_tokens=6)
    first = _request(0, 13, max_new=1)
    s.add(first)
    _run(s)  # 13 prompt tokens in chunks of 6: pages of tokens 0..11 are now cached
    again = _request(1, 13, max_new=1)  # the same prompt
    s.add(again)
    out = s.schedule()
    (entry,) = out.entries
    assert len(entry.kv.tokens) == 13  # 12 cached + 1 computed: one step despite the 6-token budget
    m.fetch(out.kv_requests)
    assert entry.kv.cached_tokens == 12 and len(entry.kv.new_tokens) == 1
    s.abort_all()


def test_a_running_batch_that_fits_is_checked_with_one_can_fetch():
    m = _manager(max_batch_size=8)
    s = _scheduler(m)
    for i in range(8):
        s.add(_request(i, 3, max_new=8))
    _step(s)  # admits all eight
    calls = []
    can_fetch = m.can_fetch
    m.can_fetch = lambda batch, num_steps=1: calls.append(len(batch)) or can_fetch(batch, num_steps)
    out = _step(s)
    assert len(out.entries) == 8 and not out.preempted
    assert calls == [8]
