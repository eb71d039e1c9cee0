"""Random claim / fetch / step / release sequences against each manager, invariants after every rule.

The machine plays the attention op: after each fetch it writes a marker for every new token
at the position the returned inputs assign, and keeps a shadow of each live sequence's
committed tokens. The invariants check the bookkeeping (no page owned twice, ref counts equal
holders, free + used == total) and that no live sequence's cache contents were overwritten.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvgraph import (
    DuplicateSequenceError,
    KVRequest,
    NoFreeSlotsError,
    OutOfPagesError,
    PagedKVCacheManager,
    SequenceLengthError,
    StepError,
    UnknownSequenceError,
)
from tests.cache.kv_checks import (
    check_contents,
    check_invariants,
    make_manager,
    raises_unchanged,
    write_steps,
)

MAX_SEQ_LEN = 24
# prompts share prefixes so that prefix caching hits, partially matches and diverges
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4])
TOKENS = st.integers(0, 3)


@st.composite
def prompts(draw):
    base = draw(st.sampled_from(BASES))
    prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(TOKENS, max_size=3))
    return prompt or [draw(TOKENS)]


@settings(max_examples=50, stateful_step_count=30, deadline=None)
class ManagerMachine(RuleBasedStateMachine):
    kind = ""

    def __init__(self):
        super().__init__()
        self.m = make_manager(self.kind, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, num_pages=14, page_size=2)
        self.shadow: dict[int, list[int]] = {}  # committed tokens of each live sequence
        self.pending: set[int] = set()  # fetched, not stepped

    @initialize(n=st.integers(1, 3))
    def first_claim(self, n):
        self.claim(n)

    @rule(n=st.integers(0, 3))
    def claim(self, n):
        if n > len(self.m.slots_remaining):
            raises_unchanged(self.m, NoFreeSlotsError, self.m.claim, n)
            return
        free = sorted(self.m.slots_remaining)
        ids = self.m.claim(n)
        assert ids == free[:n]
        for seq_id in ids:
            assert seq_id not in self.shadow
            self.shadow[seq_id] = []

    @precondition(lambda self: self.shadow)
    @rule(data=st.data(), num_steps=st.integers(1, 3), commit=st.booleans())
    def fetch(self, data, num_steps, commit):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.shadow)), min_size=1, max_size=3, unique=True))
        batch = [
            KVRequest(i, data.draw(prompts()) if not self.shadow[i] else data.draw(st.lists(TOKENS, min_size=1, max_size=2)))
            for i in ids
        ]
        if self.pending.intersection(ids):
            raises_unchanged(self.m, StepError, self.m.fetch, batch, num_steps, match="not stepped")
            return
        if any(len(self.shadow[r.seq_id]) + len(r.tokens) + num_steps - 1 > MAX_SEQ_LEN for r in batch):
            raises_unchanged(self.m, SequenceLengthError, self.m.fetch, batch, num_steps)
            return
        if not self.m.can_fetch(batch, num_steps):
            raises_unchanged(self.m, OutOfPagesError, self.m.fetch, batch, num_steps)
            return
        (x,) = self.m.fetch(batch, num_steps)
        self.pending.update(ids)
        committed = [self.shadow[r.seq_id] for r in batch]
        for r, done in zip(batch, committed, strict=True):
            assert 0 <= r.cached_tokens < len(r.tokens)
            assert r.cached_tokens == 0 or (not done and self.m.params.enable_prefix_caching)
        # cache_lengths: committed tokens plus a prefix hit; the hit's contents are the prompt's
        assert x.cache_lengths.tolist() == [len(d) + r.cached_tokens for r, d in zip(batch, committed, strict=True)]
        check_contents(self.m, {r.seq_id: list(r.tokens[: r.cached_tokens]) for r in batch if r.cached_tokens})
        new_counts = [len(r.new_tokens) for r in batch]
        assert x.max_lengths[0].tolist() == [max(new_counts), max(x.cache_lengths.tolist()[b] + n for b, n in enumerate(new_counts))]
        extras = [data.draw(st.lists(TOKENS, min_size=num_steps - 1, max_size=num_steps - 1)) for _ in batch]
        histories = [d + list(r.tokens) + e for r, d, e in zip(batch, committed, extras, strict=True)]
        starts = [len(d) + r.cached_tokens for r, d in zip(batch, committed, strict=True)]
        write_steps(self.m, x, histories, starts, new_counts, num_steps)
        if not commit:
            return
        for r, e in zip(batch, extras, strict=True):
            r.tokens = list(r.tokens) + e
        self.m.step(batch)
        for r, h in zip(batch, histories, strict=True):
            self.shadow[r.seq_id] = h
            assert self.m.cache_length(r.seq_id) == len(h)
        self.pending.difference_update(ids)

    @precondition(lambda self: self.shadow)
    @rule(data=st.data())
    def release(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
        self.m.release(seq_id)
        del self.shadow[seq_id]
        self.pending.discard(seq_id)

    @rule(data=st.data(), mistake=st.sampled_from(["release_unknown", "step_unfetched", "repeated_id"]))
    def caller_mistake(self, data, mistake):
        unfetched = sorted(set(self.shadow) - self.pending)
        if mistake == "step_unfetched" and unfetched:
            batch = [KVRequest(data.draw(st.sampled_from(unfetched)), [1])]
            raises_unchanged(self.m, StepError, self.m.step, batch)
        elif mistake == "repeated_id" and self.shadow:
            seq_id = data.draw(st.sampled_from(sorted(self.shadow)))
            batch = [KVRequest(seq_id, [1]), KVRequest(seq_id, [2])]
            raises_unchanged(self.m, DuplicateSequenceError, self.m.fetch, batch)
        else:
            seq_id = data.draw(st.integers(100, 103))
            raises_unchanged(self.m, UnknownSequenceError, self.m.release, seq_id)

    @invariant()
    def bookkeeping_holds(self):
        check_invariants(self.m)

    @invariant()
    def live_contents_are_intact(self):
        check_contents(self.m, self.shadow)

    def teardown(self):
        for seq_id in list(self.shadow):
            self.m.release(seq_id)
        check_invariants(self.m)
        assert self.m.slots_remaining == set(range(self.m.max_batch_size))
        if isinstance(self.m, PagedKVCacheManager):
            assert self.m.free_pages == self.m.total_pages


class ContinuousMachine(ManagerMachine):
    kind = "continuous"


class PagedMachine(ManagerMachine):
    kind = "paged"


class PrefixCachingMachine(ManagerMachine):
    kind = "prefix"


TestContinuousManager = ContinuousMachine.TestCase
TestPagedManager = PagedMachine.TestCase
TestPrefixCachingManager = PrefixCachingMachine.TestCase
