"""ContinuousBatchingKVCacheManager: one max_seq_len slot per sequence."""

import pytest
import torch

from kvgraph import InvalidParamsError, KVRequest
from kvgraph.cache.managers import ContinuousBatchingKVCacheManager
from tests.cache.kv_checks import continuous_params, paged_params


def test_blocks_are_zeroed_slots_of_max_seq_len():
    params = continuous_params(dtype=torch.float16)
    m = ContinuousBatchingKVCacheManager(params, max_batch_size=3, max_seq_len=7)
    assert m.blocks.shape == (3, 2, 2, 7, 2, 2)
    assert m.blocks.dtype == torch.float16 and m.blocks.device == params.device
    assert not m.blocks.any()


def test_lookup_table_maps_rows_to_slots_which_are_the_seq_ids():
    m = ContinuousBatchingKVCacheManager(continuous_params(), 4, 8)
    ids = m.claim(3)
    assert ids == [0, 1, 2]
    batch = [KVRequest(ids[2], [1]), KVRequest(ids[0], [2, 3])]
    (x,) = m.fetch(batch)
    assert x.lookup_table.shape == (2,)
    assert x.lookup_table.tolist() == [ids[2], ids[0]]


def test_released_slot_is_reused_lowest_first():
    m = ContinuousBatchingKVCacheManager(continuous_params(), 3, 8)
    a, b, c = m.claim(3)
    m.release(b)
    m.release(a)
    assert m.claim(2) == [0, 1]
    assert m.slots_remaining == set() and m.contains(c)


def test_rejects_paged_params_and_bad_sizes():
    with pytest.raises(InvalidParamsError, match="cache_strategy=continuous"):
        ContinuousBatchingKVCacheManager(paged_params(), 2, 8)
    with pytest.raises(InvalidParamsError, match=r"max_batch_size.*positive.*\b0\b"):
        ContinuousBatchingKVCacheManager(continuous_params(), 0, 8)
    with pytest.raises(InvalidParamsError, match="max_seq_len"):
        ContinuousBatchingKVCacheManager(continuous_params(), 2, -3)


def test_memory_size_and_optimal_batch():
    params = continuous_params(dtype=torch.bfloat16)
    per_slot = 100 * params.bytes_per_token
    L = params.num_layers
    size = ContinuousBatchingKVCacheManager.estimated_memory_size(params, 3, 100, L, 10**12, [params.device])
    assert size == 3 * per_slot
    m = ContinuousBatchingKVCacheManager(params, 3, 100)
    assert size == m.blocks.numel() * m.blocks.element_size()
    infer = ContinuousBatchingKVCacheManager.infer_optimal_batch_size
    assert infer(params, 100, L, 5 * per_slot - 1, [params.device]) == 4
    assert infer(params, 100, L, per_slot - 1, [params.device]) == 0
    with pytest.raises(InvalidParamsError, match="available_cache_memory"):
        infer(params, 100, L, -1, [params.device])
