import pytest
import torch

from kvgraph import InvalidParamsError, KVCacheError, KVCacheParams, KVCacheStrategy
from tests.naming import raises_naming


def test_defaults_are_paged_with_page_size_16():
    p = KVCacheParams(torch.float16, n_kv_heads=2, head_dim=64, num_layers=4)
    assert p.cache_strategy is KVCacheStrategy.PAGED
    assert p.page_size == 16
    assert p.device == torch.device("cpu")
    assert p.is_paged


def test_byte_counts_follow_the_layout():
    p = KVCacheParams(torch.bfloat16, n_kv_heads=8, head_dim=128, num_layers=32, page_size=16)
    assert p.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert p.page_bytes == p.bytes_per_token * 16
    blocks = torch.empty(1, 2, 32, 16, 8, 128, dtype=torch.bfloat16)
    assert p.page_bytes == blocks.numel() * blocks.element_size()


def test_strategy_parses_strings():
    p = KVCacheParams(torch.float32, 1, 8, 1, page_size=None, cache_strategy="continuous")
    assert p.cache_strategy is KVCacheStrategy.CONTINUOUS
    assert not p.is_paged
    with raises_naming(InvalidParamsError, "page_bytes", "page_size"):
        _ = p.page_bytes


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(n_kv_heads=0), ("n_kv_heads", "positive", "0")),
        (dict(head_dim=-64), ("head_dim", "positive", "-64")),
        (dict(num_layers=2.0), ("num_layers", "positive", "2.0")),
        (dict(page_size=0), ("page_size", "positive", "0")),
        (dict(page_size=None), ("page_size", "PAGED", "None")),
        (dict(dtype=torch.int32), ("dtype", "floating", "torch.int32")),
        (dict(cache_strategy="ring"), ("cache strategy", "'ring'")),
        (
            dict(cache_strategy="continuous", enable_prefix_caching=True),
            ("enable_prefix_caching=True", "cache_strategy=PAGED", "continuous"),
        ),
    ],
)
def test_invalid_params_name_the_value(kwargs, names):
    base = dict(dtype=torch.float32, n_kv_heads=2, head_dim=8, num_layers=2)
    with raises_naming(InvalidParamsError, *names) as info:

        KVCacheParams(**{**base, **kwargs})
    assert isinstance(info.value, KVCacheError)
    assert isinstance(info.value, ValueError)
