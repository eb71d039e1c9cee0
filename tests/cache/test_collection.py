"""Collection views: layout, vectorised load/store, matrix indices, batch-level queries, errors."""

from __future__ import annotations

import pytest
import torch

from kvgraph.cache.collection import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    PagedKVCache,
    PagedKVCacheCollection,
    collection_for,
)
from kvgraph.cache.inputs import RaggedKVCacheInputs
from kvgraph.errors import CacheInputError
from tests.naming import raises_naming

L, H, D = 3, 2, 4


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def paged_inputs(page_size: int = 4) -> RaggedKVCacheInputs:
    """6 pages; sequence 0 owns pages [4, 1], sequence 1 owns page [2]; unused entries = 6."""
    blocks = torch.randn(6, 2, L, page_size, H, D, generator=torch.Generator().manual_seed(0))
    return RaggedKVCacheInputs(
        blocks=blocks,
        cache_lengths=i32([5, 0]),
        lookup_table=i32([[4, 1, 6], [2, 6, 6]]),
        max_lengths=i32([[3, 8], [1, 9]]),
    )


def continuous_inputs(max_seq_len: int = 8) -> RaggedKVCacheInputs:
    """3 slots; sequence 0 is in slot 2, sequence 1 in slot 0."""
    blocks = torch.randn(3, 2, L, max_seq_len, H, D, generator=torch.Generator().manual_seed(0))
    return RaggedKVCacheInputs(
        blocks=blocks, cache_lengths=i32([5, 0]), lookup_table=i32([2, 0]), max_lengths=i32([[3, 8]])
    )


def test_collection_for_picks_the_class_by_lookup_rank():
    assert isinstance(collection_for(paged_inputs()), PagedKVCacheCollection)
    assert isinstance(collection_for(continuous_inputs()), ContinuousBatchingKVCacheCollection)
    assert isinstance(collection_for(paged_inputs()).get_key_cache(0), PagedKVCache)
    assert isinstance(collection_for(continuous_inputs()).get_value_cache(0), ContinuousBatchingKVCache)


def test_wrong_lookup_rank_raises():
    inputs = paged_inputs()
    inputs.lookup_table = inputs.lookup_table[..., None]
    with raises_naming(CacheInputError, "lookup_table", "rank 2 (paged)", "1 (continuous)", "rank 3"):
        collection_for(inputs)
    with raises_naming(CacheInputError, "PagedKVCacheCollection", "lookup_table", "rank 2", "rank 1"):
        PagedKVCacheCollection.from_inputs(continuous_inputs())
    with raises_naming(CacheInputError, "ContinuousBatchingKVCacheCollection", "lookup_table", "rank 1", "rank 2"):
        ContinuousBatchingKVCacheCollection.from_inputs(paged_inputs())


def test_max_constructor_and_fields():
    """MAX: Collection(blocks, cache_lengths, lookup_table, max_seq_length, max_cache_length)."""
    x = continuous_inputs()
    c = ContinuousBatchingKVCacheCollection(x.blocks, x.cache_lengths, x.lookup_table, 3, 8)
    assert c.blocks is x.blocks and c.cache_lengths is x.cache_lengths and c.lookup_table is x.lookup_table
    assert (c.max_seq_length, c.max_cache_length) == (3, 8)
    assert c.cache_length(0) == 5 and c.get_key_cache(1).max_cache_length == 8
    assert torch.equal(c.get_value_cache(2).load(0, 1), x.blocks[2, 1, 2, 1])
    p = paged_inputs()
    pc = PagedKVCacheCollection(p.blocks, p.cache_lengths, p.lookup_table, max_seq_length=3, max_cache_length=8)
    assert pc.get_key_cache(0).page_size == 4 and pc.batch_size == 2
    with raises_naming(CacheInputError, "cache_lengths", "[batch]", "batch 2", "(1,)"):
        PagedKVCacheCollection(p.blocks, p.cache_lengths[:1], p.lookup_table, 3, 8)


def test_bad_blocks_and_max_lengths_raise():
    inputs = paged_inputs()
    inputs.blocks = inputs.blocks[:, :1]
    with raises_naming(CacheInputError, "blocks", "[N, 2, num_layers, rows, Hkv, D]"):
        collection_for(inputs)
    inputs = paged_inputs()
    inputs.max_lengths = i32([3, 8])
    with raises_naming(CacheInputError, "max_lengths", "[num_steps >= 1, 2]", "(2,)"):
        collection_for(inputs)


@pytest.mark.parametrize("layer", [-1, L])
def test_layer_out_of_range_raises(layer):
    with raises_naming(CacheInputError, f"layer_idx {layer}", f"{L} layers"):

        collection_for(paged_inputs()).get_key_cache(layer)


def test_batch_level_queries():
    collection = collection_for(paged_inputs())
    assert collection.num_layers == L and collection.batch_size == 2
    assert [collection.cache_length(b) for b in range(2)] == [5, 0]
    keys = collection.get_key_cache(1)
    assert keys.cache_length(0) == 5 and keys.page_size == 4
    assert keys.max_prompt_length() == 3 and keys.max_context_length() == 8
    assert not keys.empty_cache()
    prefill = paged_inputs()
    prefill.cache_lengths = i32([0, 0])
    assert collection_for(prefill).get_value_cache(0).empty_cache()


def test_views_alias_the_blocks():
    inputs = paged_inputs()
    keys, values = collection_for(inputs).get_key_cache(2), collection_for(inputs).get_value_cache(2)
    assert keys.blocks.data_ptr() == inputs.blocks[:, 0, 2].data_ptr()
    assert values.blocks.data_ptr() == inputs.blocks[:, 1, 2].data_ptr()


def test_paged_load_follows_the_lookup_table():
    inputs = paged_inputs(page_size=4)
    keys = collection_for(inputs).get_key_cache(1)
    # sequence 0, positions 0..5 -> page 4 rows 0..3, then page 1 rows 0..1
    got = keys.load(torch.zeros(6, dtype=torch.long), torch.arange(6))
    want = torch.cat([inputs.blocks[4, 0, 1, :4], inputs.blocks[1, 0, 1, :2]])
    assert got.shape == (6, H, D)
    assert torch.equal(got, want)
    assert torch.equal(keys.load(1, 3), inputs.blocks[2, 0, 1, 3])


def test_continuous_load_follows_the_slot():
    inputs = continuous_inputs()
    values = collection_for(inputs).get_value_cache(0)
    got = values.load(torch.tensor([0, 0, 1]), torch.tensor([0, 7, 2]))
    want = torch.stack([inputs.blocks[2, 1, 0, 0], inputs.blocks[2, 1, 0, 7], inputs.blocks[0, 1, 0, 2]])
    assert torch.equal(got, want)


@pytest.mark.parametrize("make", [paged_inputs, continuous_inputs], ids=["paged", "continuous"])
def test_store_writes_only_the_given_rows(make):
    inputs = make()
    expected = inputs.blocks.clone()
    keys = collection_for(inputs).get_key_cache(1)
    batch_idx, pos = torch.tensor([0, 0, 1]), torch.tensor([5, 6, 0])
    new = torch.randn(3, H, D)
    keys.store(batch_idx, pos, new)
    for i in range(3):
        block, row = _location(inputs, int(batch_idx[i]), int(pos[i]))
        expected[block, 0, 1, row] = new[i]
    assert torch.equal(inputs.blocks, expected)
    assert torch.equal(keys.load(batch_idx, pos), new)


def _location(inputs: RaggedKVCacheInputs, b: int, pos: int) -> tuple[int, int]:
    """(block, row) of position ``pos`` of sequence ``b``, computed by hand."""
    if inputs.lookup_table.dim() == 1:
        return int(inputs.lookup_table[b]), pos
    page_size = inputs.blocks.shape[3]
    return int(inputs.lookup_table[b, pos // page_size]), pos % page_size


@pytest.mark.parametrize("make", [paged_inputs, continuous_inputs], ids=["paged", "continuous"])
def test_row_and_col_idx_address_the_matrix_view(make):
    inputs = make()
    cache = collection_for(inputs).get_key_cache(2)
    matrix = inputs.blocks[:, 0, 2].reshape(-1, H * D)  # [blocks * rows, Hkv * D]
    for b, pos in [(0, 0), (0, 4), (0, 6), (1, 2)]:
        row = int(cache.row_idx(b, pos))
        for h in range(H):
            col = int(cache.col_idx(h))
            assert torch.equal(matrix[row, col : col + D], cache.load(b, pos)[h])
    rows = cache.row_idx(torch.tensor([0, 1]), torch.tensor([4, 2]))
    assert rows.dtype == torch.long and rows.shape == (2,)


@pytest.mark.parametrize("make", [paged_inputs, continuous_inputs], ids=["paged", "continuous"])
def test_load_padded_reads_each_prefix_and_zero_pads(make):
    inputs = make()
    inputs.blocks[:, :, 0] = float("nan")  # layer 0 is garbage except the rows written below
    collection = collection_for(inputs)
    keys = collection.get_key_cache(0)
    lengths = torch.tensor([6, 2])
    for b, n in enumerate(lengths.tolist()):
        keys.store(torch.full((n,), b), torch.arange(n), torch.full((n, H, D), float(b + 1)))
    padded = keys.load_padded(lengths, 7)
    assert padded.shape == (2, 7, H, D)
    assert (padded[0, :6] == 1).all() and (padded[1, :2] == 2).all()
    assert (padded[0, 6:] == 0).all() and (padded[1, 2:] == 0).all()
