"""Both cache strategies are addressed as pages, as views of the cache (no copies)."""

import pytest
import torch

from kvgraph.ops.triton.layout import PagedLayer, next_power_of_2, padded_head_dim


@pytest.mark.parametrize("n, expected", [(1, 1), (2, 2), (3, 4), (17, 32), (64, 64), (97, 128)])
def test_next_power_of_2(n, expected):
    assert next_power_of_2(n) == expected


@pytest.mark.parametrize("head_dim, expected", [(8, 16), (64, 64), (80, 128), (96, 128), (256, 256)])
def test_padded_head_dim_is_a_power_of_two_of_at_least_16(head_dim, expected):
    assert padded_head_dim(head_dim) == expected


def test_paged_layer_is_a_view_with_the_page_strides():
    blocks = torch.zeros(7, 2, 3, 16, 2, 8)  # [pages, kv, layers, page_size, Hkv, D]
    lookup = torch.zeros(4, 5, dtype=torch.int32)
    layer = PagedLayer.of(blocks, lookup, layer_idx=2)
    assert layer.page_size == 16 and layer.num_pages == 7
    assert layer.layer.data_ptr() == blocks[:, :, 2].data_ptr()
    assert layer.cache_strides == (blocks.stride(0), blocks.stride(1), blocks.stride(3), blocks.stride(4))
    assert layer.lookup_strides == (5, 1)


def test_continuous_cache_is_one_page_per_slot():
    blocks = torch.zeros(3, 2, 2, 40, 1, 8)  # [slots, kv, layers, max_seq_len, Hkv, D]
    lookup = torch.tensor([2, 0], dtype=torch.int32)
    layer = PagedLayer.of(blocks, lookup, layer_idx=1)
    assert layer.page_size == 40 and layer.num_pages == 3
    assert layer.lookup_strides == (1, 0)  # every position reads the slot's single entry
    assert layer.kernel_args()[:2] == (layer.layer, lookup)
