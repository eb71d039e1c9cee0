"""load_kv_manager picks the class by params.cache_strategy."""

import pytest
import torch

from kvgraph import InvalidParamsError
from kvgraph.cache.managers import (
    ContinuousBatchingKVCacheManager,
    PagedKVCacheManager,
    load_kv_manager,
)
from tests.cache.kv_checks import continuous_params, paged_params
from tests.naming import raises_naming


def test_continuous_strategy_gives_slots():
    m = load_kv_manager(continuous_params(), 3, 16)
    assert isinstance(m, ContinuousBatchingKVCacheManager)
    assert m.blocks.shape[0] == 3 and m.blocks.shape[3] == 16


def test_paged_default_pool_holds_every_sequence_at_full_length():
    m = load_kv_manager(paged_params(page_size=4), 3, 10)
    assert isinstance(m, PagedKVCacheManager)
    assert m.total_pages == 3 * 3


def test_paged_options_pass_through():
    params = paged_params(page_size=4)
    assert load_kv_manager(params, 3, 10, num_pages=5).total_pages == 5
    assert load_kv_manager(params, 3, 10, available_cache_memory=2 * params.page_bytes).total_pages == 2


def test_max_positional_call():
    """MAX's load_kv_manager(params, max_batch_size, max_seq_len, num_layers, devices, session,
    available_cache_memory)."""
    params = paged_params(page_size=4)
    m = load_kv_manager(params, 3, 10, params.num_layers, [params.device], None, 5 * params.page_bytes)
    assert isinstance(m, PagedKVCacheManager) and m.total_pages == 5
    c = load_kv_manager(continuous_params(), 3, 10, 2, [torch.device("cpu")], None, 10**9)
    assert isinstance(c, ContinuousBatchingKVCacheManager) and c.blocks.shape[0] == 3


def test_continuous_rejects_paged_options():
    with raises_naming(InvalidParamsError, "num_pages=5", "cache_strategy=paged", "continuous"):

        load_kv_manager(continuous_params(), 3, 10, num_pages=5)
    with pytest.raises(InvalidParamsError):
        load_kv_manager(continuous_params(), 0, 10)
