"""Zeroed cache memory: zeros of the asked shape and dtype, and on the CPU no memory until written."""

import gc
import os

import pytest
import torch

from kvgraph.cache.managers.paged import PagedKVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.cache.zeroed import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_zeroed_is_a_writable_contiguous_tensor_of_zeros_that_keeps_its_memory(dtype):
    t = zeroed((3, 2, 5, 4), dtype, "cpu")
    assert t.shape == (3, 2, 5, 4) and t.dtype == dtype and t.is_contiguous()
    assert not t.float().any()
    t[1, 1].fill_(1)
    view = t[1]
    del t
    gc.collect()  # the mapping lives as long as any tensor over it
    assert view.float().sum().item() == 5 * 4 and not view[0].float().any()


def test_an_empty_shape_is_an_empty_tensor():
    assert zeroed((0, 4), torch.float32, "cpu").shape == (0, 4)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc")
def test_cpu_memory_is_resident_only_once_written():
    size = 256 << 20
    before = _resident_bytes()
    t = zeroed((size // 4,), torch.float32, "cpu")
    assert _resident_bytes() - before < size // 8  # torch.zeros would make all 256 MiB resident here
    t[: size // 8].fill_(1.0)
    assert _resident_bytes() - before >= size // 8 // 2


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc")
def test_a_paged_pool_starts_zeroed_and_not_resident():
    params = KVCacheParams(dtype=torch.float32, n_kv_heads=2, head_dim=64, num_layers=4, page_size=16)
    before = _resident_bytes()
    manager = PagedKVCacheManager(params, max_batch_size=2, max_seq_len=64, num_pages=8192)
    size = manager.blocks.numel() * 4  # 512 MiB
    assert _resident_bytes() - before < size // 8
    assert manager.blocks.shape == (8192, 2, 4, 16, 2, 64) and not manager.blocks[:64].any()
