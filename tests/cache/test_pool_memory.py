"""A CPU cache pool's memory: zeroed, shaped and typed as ``torch.zeros``; from 2 MB up on Linux it
starts on a 2 MB boundary of a mapping advised for transparent huge pages, mapped page by page as
it is first written (``KVGRAPH_POOL_POPULATE=lazy``, the default) or before it is returned
(``eager``), and unmapped with the pool, which ``KVGRAPH_HUGE_PAGES=0`` turns off; other devices and
small pools are plain ``torch.zeros``."""

import sys

import pytest
import torch

from kvgraph.cache import pool_memory
from kvgraph.cache.managers import PagedKVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.errors import ConfigError
from tests.huge_pages import resident_bytes, thp_eligible, thp_mode

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
POOL = (64, 2, 4, 16, 4, 64)  # 8 MB of float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_pool_is_zeros_of_its_shape_and_dtype(dtype):
    pool = pool_memory.zeros(POOL, dtype, "cpu")
    assert pool.shape == POOL and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[-1, -1, -1, -1, -1, -1] = 1  # writable to its last element
    assert int(pool.count_nonzero()) == 1


@linux
def test_a_large_pool_starts_on_a_huge_page_of_advised_memory():
    pool = pool_memory.zeros(POOL, torch.float32, "cpu")
    assert pool.data_ptr() % pool_memory.HUGE_PAGE == 0
    eligible = thp_eligible(pool.data_ptr())  # None: a kernel whose smaps does not say
    if thp_mode() in ("always", "madvise") and eligible is not None:
        assert eligible is True


@linux
def test_a_pool_maps_only_the_pages_written_by_default(monkeypatch):
    monkeypatch.delenv("KVGRAPH_POOL_POPULATE", raising=False)
    pool = pool_memory.zeros(POOL, torch.float32, "cpu")
    address, nbytes = pool.data_ptr(), pool.numel() * 4
    assert resident_bytes(address) == 0  # nothing mapped yet: the start paid for no page
    pool[-1, -1, -1, -1, -1, -1] = 1.0
    assert 0 < resident_bytes(address) <= pool_memory.HUGE_PAGE < nbytes  # the page written, no other
    assert int(pool.count_nonzero()) == 1
    del pool
    assert resident_bytes(address) is None


@linux
@pytest.mark.parametrize("threads", [1, 2])
def test_an_eager_pool_is_resident_before_it_is_returned_and_unmapped_with_it(monkeypatch, threads):
    monkeypatch.setenv("KVGRAPH_POOL_POPULATE", "eager")
    monkeypatch.setattr(pool_memory, "POPULATE_SPLIT", 2 << 20)  # slices for two threads from 4 MB
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool = pool_memory.zeros(POOL, torch.float32, "cpu")
    finally:
        torch.set_num_threads(previous)
    address, nbytes = pool.data_ptr(), pool.numel() * 4
    assert resident_bytes(address) >= nbytes  # every page mapped: no fault left for the first step
    assert not pool.any()
    del pool
    assert resident_bytes(address) is None


@linux
def test_a_kernel_refusing_to_populate_still_gives_a_resident_zero_pool(monkeypatch):
    monkeypatch.setenv("KVGRAPH_POOL_POPULATE", "eager")
    monkeypatch.setattr(pool_memory, "MADV_POPULATE_WRITE", -1)  # EINVAL, as a kernel before 5.14
    pool = pool_memory.zeros(POOL, torch.float32, "cpu")
    assert resident_bytes(pool.data_ptr()) >= pool.numel() * 4  # written with zeros instead
    assert not pool.any()
    pool.fill_(2.0)
    assert float(pool.sum()) == 2.0 * pool.numel()


@linux
@pytest.mark.parametrize("value", ["background", "EAGER", ""])
def test_an_unknown_populate_mode_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("KVGRAPH_POOL_POPULATE", value)
    with pytest.raises(ConfigError, match=f"KVGRAPH_POOL_POPULATE='{value}'.*lazy, eager"):
        pool_memory.zeros(POOL, torch.float32, "cpu")


@linux
def test_huge_pages_off_gives_plain_zeros(monkeypatch):
    monkeypatch.setenv("KVGRAPH_HUGE_PAGES", "0")
    pool = pool_memory.zeros(POOL, torch.float32, "cpu")
    assert pool.storage_offset() == 0 and pool.untyped_storage().nbytes() == pool.numel() * 4
    assert not pool.any()


def test_small_pools_and_other_devices_are_plain_zeros():
    small = pool_memory.zeros((2, 2, 1, 16, 1, 8), torch.float32, "cpu")
    assert small.storage_offset() == 0 and not small.any()
    meta = pool_memory.zeros(POOL, torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == POOL


@linux
def test_a_paged_managers_pool_is_advised():
    params = KVCacheParams(dtype=torch.float32, n_kv_heads=4, head_dim=64, num_layers=4, page_size=16)
    manager = PagedKVCacheManager(params, 4, 256, num_pages=64)  # 8 MB
    assert manager.device_blocks[0].data_ptr() % pool_memory.HUGE_PAGE == 0
    assert not manager.device_blocks[0].any()


def test_a_pool_larger_than_the_memory_available_is_refused_naming_both_sizes(monkeypatch):
    monkeypatch.setattr(pool_memory, "available_bytes", lambda: 4 << 20)
    params = KVCacheParams(dtype=torch.float32, n_kv_heads=4, head_dim=64, num_layers=4, page_size=16)
    with pytest.raises(ConfigError, match=r"needs 8388608 bytes, more than the 4194304 bytes of memory available"):
        PagedKVCacheManager(params, 4, 256, num_pages=64)  # 8 MB
    assert PagedKVCacheManager(params, 4, 256, num_pages=16).device_blocks[0].shape[0] == 16  # 2 MB fits


@linux
def test_the_memory_available_is_read_from_the_kernel():
    available = pool_memory.available_bytes()
    assert available is not None and 0 < available
