"""Behaviour both managers share: the MAX lifecycle, validation, graph inputs, multistep."""

import pytest
import torch

from kvgraph import (
    BatchSizeError,
    CacheInputError,
    DuplicateSequenceError,
    InvalidParamsError,
    KVRequest,
    NoFreeSlotsError,
    SequenceLengthError,
    StepError,
    UnknownSequenceError,
)
from kvgraph.cache.managers.base import max_lengths_tensor
from kvgraph.cache.symbols import ragged_input_symbols
from tests.cache.kv_checks import (
    KINDS,
    check_contents,
    check_invariants,
    continuous_params,
    make_manager,
    paged_params,
    raises_unchanged,
    write_steps,
)
from tests.naming import raises_naming


def test_ragged_input_symbols_paged_layout():
    s = ragged_input_symbols(paged_params(page_size=8))
    assert s.names() == ("kv_blocks", "cache_lengths", "lookup_table", "max_lengths")
    assert s.kv_blocks.shape == ("total_num_pages", 2, 2, 8, 2, 2)
    assert s.lookup_table.shape == ("batch_size", "max_num_pages")
    assert s.cache_lengths.dtype == s.lookup_table.dtype == s.max_lengths.dtype == torch.int32
    assert s.max_lengths.shape == ("steps_remaining", 2) and s.max_lengths.device.type == "cpu"


def test_ragged_input_symbols_continuous_layout():
    s = ragged_input_symbols(continuous_params())
    assert s.kv_blocks.shape == ("max_batch_size", 2, 2, "max_seq_len", 2, 2)
    assert s.lookup_table.shape == ("batch_size",)


def test_max_lengths_rows_grow_by_one_per_step():
    t = max_lengths_tensor([5, 1], [5, 9], 3)
    assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert t.tolist() == [[5, 9], [1, 10], [1, 11]]


@pytest.mark.parametrize("kind", KINDS)
def test_claim_contains_release(kind):
    m = make_manager(kind, max_batch_size=3)
    assert m.slots_remaining == {0, 1, 2}
    ids = m.claim(2)
    assert ids == [0, 1] and all(m.contains(i) for i in ids)
    assert m.slots_remaining == {2}
    m.release(ids[0])
    assert not m.contains(ids[0]) and m.slots_remaining == {0, 2}
    assert m.claim(0) == []
    again = m.claim(2)
    assert again == [0, 2] and m.slots_remaining == set()


@pytest.mark.parametrize("kind", KINDS)
def test_seq_ids_are_slots_reused_after_release(kind):
    """MAX: claim hands out ids from slots_remaining, always in range(max_batch_size)."""
    m = make_manager(kind, max_batch_size=2)
    m.claim(2)
    m.release(0)
    assert m.claim(1) == [0]
    for _ in range(5):
        m.release(1)
        (seq,) = m.claim(1)
        assert seq == 1 and seq in range(m.max_batch_size)
    check_invariants(m)


@pytest.mark.parametrize("kind", KINDS)
def test_claim_errors_leave_state_unchanged(kind):
    m = make_manager(kind, max_batch_size=2)
    m.claim(1)
    raises_unchanged(m, NoFreeSlotsError, m.claim, 2, naming=("claim(2)", "1 free slot", "max_batch_size=2"))
    raises_unchanged(m, BatchSizeError, m.claim, -1, match="-1")


@pytest.mark.parametrize("kind", KINDS)
def test_external_claim(kind):
    m = make_manager(kind, max_batch_size=4)
    m.external_claim([3, 1])
    assert m.contains(3) and m.contains(1) and m.slots_remaining == {0, 2}
    raises_unchanged(m, DuplicateSequenceError, m.external_claim, [3], naming=("seq_id 3",))
    raises_unchanged(m, DuplicateSequenceError, m.external_claim, [2, 2], match="repeat")
    raises_unchanged(m, NoFreeSlotsError, m.external_claim, [100], naming=("seq_id 100", "slot", "0..3"))
    raises_unchanged(m, NoFreeSlotsError, m.external_claim, [0, 4], naming=("seq_id 4", "slot", "0..3"))
    raises_unchanged(m, NoFreeSlotsError, m.external_claim, [-1], naming=("seq_id -1", "slot", "0..3"))
    raises_unchanged(m, InvalidParamsError, m.external_claim, ["0"], match="'0'")
    assert m.claim(1) == [0]


@pytest.mark.parametrize("kind", KINDS)
def test_release_unclaimed_raises(kind):
    m = make_manager(kind)
    (a,) = m.claim(1)
    raises_unchanged(m, UnknownSequenceError, m.release, a + 100, match=str(a + 100))
    m.release(a)
    raises_unchanged(m, UnknownSequenceError, m.release, a)


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_validation_leaves_state_unchanged(kind):
    m = make_manager(kind, max_batch_size=2, max_seq_len=16)
    a, b = m.claim(2)
    m.fetch([r := KVRequest(a, [1, 2, 3])])
    m.step([r])
    cases = [
        (UnknownSequenceError, [KVRequest(99, [1])], 1, "99"),
        (BatchSizeError, [], 1, "batch of 0"),
        (BatchSizeError, [KVRequest(a, [1]), KVRequest(b, [1]), KVRequest(a, [1])], 1, "max_batch_size=2"),
        (DuplicateSequenceError, [KVRequest(a, [1]), KVRequest(a, [2])], 1, "repeats"),
        (SequenceLengthError, [KVRequest(b, [])], 1, "empty"),
        (InvalidParamsError, [KVRequest(b, [1])], 0, "num_steps"),
        (SequenceLengthError, [KVRequest(a, list(range(14)))], 1, ("17 tokens", "max_seq_len=16")),
        (SequenceLengthError, [KVRequest(a, [1])], 14, "max_seq_len=16"),
    ]
    for error, batch, num_steps, match in cases:
        names = match if isinstance(match, tuple) else ()
        raises_unchanged(m, error, m.fetch, batch, num_steps, match=match, naming=names)
        raises_unchanged(m, error, m.can_fetch, batch, num_steps, match=match, naming=names)
    assert m.can_fetch([KVRequest(a, list(range(12)))])


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_returns_max_style_inputs(kind):
    m = make_manager(kind, max_seq_len=32)
    a, b = m.claim(2)
    ra, rb = KVRequest(a, [1, 2, 3, 4, 5]), KVRequest(b, [6, 7])
    (x,) = m.fetch([ra, rb])
    assert x.blocks is m.blocks
    assert x.cache_lengths.tolist() == [0, 0] and x.cache_lengths.dtype == torch.int32
    assert x.lookup_table.dtype == torch.int32
    assert x.max_lengths.tolist() == [[5, 5]] and x.max_lengths.device.type == "cpu"
    assert ra.cached_tokens == rb.cached_tokens == 0
    m.step([ra, rb])
    assert m.cache_length(a) == 5 and m.cache_length(b) == 2
    (x,) = m.fetch([KVRequest(a, [9]), KVRequest(b, [9])], num_steps=3)
    assert x.cache_lengths.tolist() == [5, 2]
    assert x.max_lengths.tolist() == [[1, 6], [1, 7], [1, 8]]


@pytest.mark.parametrize("kind", KINDS)
def test_step_errors_leave_state_unchanged(kind):
    m = make_manager(kind)
    a, b = m.claim(2)
    raises_unchanged(m, StepError, m.step, [KVRequest(a, [1])], match="no pending fetch")
    (x,) = m.fetch([KVRequest(a, [1, 2]), KVRequest(b, [3])])
    raises_unchanged(m, StepError, m.step, [KVRequest(a, [1, 2, 3])], naming=(f"seq {a}", "3 tokens", "2 reserved"))
    raises_unchanged(
        m, StepError, m.step, [KVRequest(b, [3], cached_tokens=1)], naming=(f"seq {b}", "cached_tokens=1", "fetch set 0")
    )
    raises_unchanged(m, UnknownSequenceError, m.step, [KVRequest(a, [1]), KVRequest(77, [1])])
    m.step([KVRequest(a, [1, 2])])
    raises_unchanged(m, StepError, m.step, [KVRequest(a, [1])], match="no pending fetch")
    m.step([KVRequest(b, [3])])
    assert (m.cache_length(a), m.cache_length(b)) == (2, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_step_may_commit_fewer_tokens_than_reserved(kind):
    m = make_manager(kind)
    (a,) = m.claim(1)
    m.fetch([KVRequest(a, [4])], num_steps=4)
    m.step([KVRequest(a, [4, 5])])  # stopped after two of four steps
    assert m.cache_length(a) == 2
    (x,) = m.fetch([KVRequest(a, [6])])
    assert x.cache_lengths.tolist() == [2]
    check_invariants(m)


@pytest.mark.parametrize("kind", KINDS)
def test_increment_cache_lengths_for_multistep(kind):
    m = make_manager(kind)
    a, b = m.claim(2)
    m.fetch(batch := [KVRequest(a, [1, 2, 3]), KVRequest(b, [4])])
    m.step(batch)
    (x,) = m.fetch([KVRequest(a, [5]), KVRequest(b, [6])], num_steps=3)
    offsets = torch.tensor([0, 1, 2], dtype=torch.int32)
    (y,) = m.increment_cache_lengths([x], offsets)
    assert y.cache_lengths.tolist() == [4, 2] and y.cache_lengths.dtype == torch.int32
    assert y.max_lengths.tolist() == [[1, 5], [1, 6]]
    assert y.blocks is x.blocks and y.lookup_table is x.lookup_table
    (z,) = m.increment_cache_lengths([y], offsets)
    assert z.cache_lengths.tolist() == [5, 3] and z.max_lengths.tolist() == [[1, 6]]
    assert x.cache_lengths.tolist() == [3, 1]
    assert (m.cache_length(a), m.cache_length(b)) == (3, 1)
    with raises_naming(CacheInputError, "max_lengths", "1 row(s)", "no step remains"):

        m.increment_cache_lengths([z], offsets)
    with raises_naming(CacheInputError, "input_row_offsets", "(2,)", "(3,)"):
        m.increment_cache_lengths([x], offsets[:2])


@pytest.mark.parametrize("kind", KINDS)
def test_cache_contents_survive_later_steps(kind):
    m = make_manager(kind, max_batch_size=3, max_seq_len=24, num_pages=18) if kind != "continuous" else (
        make_manager(kind, max_batch_size=3, max_seq_len=24)
    )
    ids = m.claim(3)
    shadow = {i: [] for i in ids}
    prompts = {ids[0]: [3, 1, 4, 1, 5, 9, 2], ids[1]: [2, 7, 1, 8, 2, 8, 1, 8, 2], ids[2]: [1]}
    for step in range(6):
        batch = [KVRequest(i, prompts[i] if step == 0 else [10 * step + i]) for i in ids]
        (x,) = m.fetch(batch)
        assert x.cache_lengths.tolist() == [len(shadow[i]) for i in ids]
        histories = [shadow[r.seq_id] + list(r.tokens) for r in batch]
        write_steps(m, x, histories, [len(shadow[i]) for i in ids], [len(r.tokens) for r in batch])
        m.step(batch)
        for r, h in zip(batch, histories, strict=True):
            shadow[r.seq_id] = h
        check_contents(m, shadow)
        check_invariants(m)


@pytest.mark.parametrize("kind", KINDS)
def test_multistep_writes_land_where_step_commits_them(kind):
    m = make_manager(kind)
    a, b = m.claim(2)
    batch = [KVRequest(a, [1, 2, 3]), KVRequest(b, [4, 5])]
    (x,) = m.fetch(batch, num_steps=3)
    extra = {a: [6, 7], b: [8, 9]}
    histories = [list(r.tokens) + extra[r.seq_id] for r in batch]
    write_steps(m, x, histories, [0, 0], [3, 2], num_steps=3)
    for r in batch:
        r.tokens = list(r.tokens) + extra[r.seq_id]
    m.step(batch)
    assert (m.cache_length(a), m.cache_length(b)) == (5, 4)
    check_contents(m, {a: histories[0], b: histories[1]})


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_without_step_raises_instead_of_dropping_the_written_tokens(kind):
    """The five tokens the first fetch wrote are never silently lost by a second fetch."""
    m = make_manager(kind)
    (a,) = m.claim(1)
    m.fetch([first := KVRequest(a, [1, 2, 3, 4, 5])])
    raises_unchanged(m, StepError, m.fetch, [KVRequest(a, [6])], naming=(f"seq {a}", "not stepped"))
    raises_unchanged(m, StepError, m.can_fetch, [KVRequest(a, [6])], match="not stepped")
    m.step([first])
    (x,) = m.fetch([r := KVRequest(a, [6])])
    assert x.cache_lengths.tolist() == [5]
    m.step([r])
    assert m.cache_length(a) == 6
    check_invariants(m)


@pytest.mark.parametrize("kind", KINDS)
def test_step_past_the_reservation_raises(kind):
    m = make_manager(kind)
    (a,) = m.claim(1)
    m.fetch([r := KVRequest(a, [1, 2, 3])])
    raises_unchanged(m, StepError, m.step, [KVRequest(a, list(range(10)))], naming=(f"seq {a}", "10 tokens", "3 reserved"))

    m.step([r])
    assert m.cache_length(a) == 3
    check_invariants(m)


@pytest.mark.parametrize("kind", KINDS)
def test_input_symbols_describe_fetched_tensors(kind):
    m = make_manager(kind)
    (symbols,) = m.input_symbols()
    assert m.num_kv_inputs() == 4
    ids = m.claim(2)
    (x,) = m.fetch([KVRequest(i, [1, 2, 3]) for i in ids], num_steps=2)
    bound: dict[str, int] = {}
    for t, tensor, name in zip(symbols, x, symbols.names(), strict=True):
        t.check(tensor, name, bound)
    assert bound["batch_size"] == 2 and bound["steps_remaining"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_inputs_and_multistep_increment_without_host_sync(kind):
    m = make_manager(kind, device="cuda")
    a, b = m.claim(2)
    m.fetch(batch := [KVRequest(a, [1, 2, 3, 4, 5]), KVRequest(b, [1, 2, 3, 4, 6])])
    m.step(batch)
    (x,) = m.fetch([KVRequest(a, [7]), KVRequest(b, [8])], num_steps=2)
    assert x.blocks.is_cuda and x.cache_lengths.is_cuda and x.lookup_table.is_cuda
    assert x.max_lengths.device.type == "cpu"
    offsets = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        (y,) = m.increment_cache_lengths([x], offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.cache_lengths.tolist() == [6, 6] and y.max_lengths.tolist() == [[1, 7]]
