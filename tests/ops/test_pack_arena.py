"""The arena packed weights live in (``csrc/pack_arena.cpp``, seen through
``kvgraph_cpu::pack_arena_zeros``): zeroed float32 tensors, each on a page of its own, one right
after the other in 2 MB-aligned memory advised for transparent huge pages; a tensor keeps its
memory whatever the arena allocates next; ``KVGRAPH_HUGE_PAGES=0`` gives ATen's own allocation."""

import pytest
import torch

from kvgraph.ops import cpp
from tests.huge_pages import thp_eligible, thp_mode

PAGE = 4096


@pytest.fixture(scope="module")
def zeros():
    if cpp.packed_linear_gemm() is None:
        pytest.skip("kvgraph's C++ library does not build here")
    return torch.ops.kvgraph_cpu.pack_arena_zeros


def test_packs_are_zeroed_and_follow_each_other(zeros, monkeypatch):
    monkeypatch.delenv("KVGRAPH_HUGE_PAGES", raising=False)
    a = zeros([3, 5, 16])
    b = zeros([7, 16])
    c = zeros([1])
    assert a.shape == (3, 5, 16) and a.dtype == torch.float32 and not a.any() and not b.any()
    assert a.data_ptr() % PAGE == 0
    assert b.data_ptr() == a.data_ptr() + PAGE  # 960 bytes round up to one page
    assert c.data_ptr() == b.data_ptr() + PAGE


def test_a_pack_larger_than_a_chunk_gets_a_chunk_of_its_own(zeros, monkeypatch):
    monkeypatch.delenv("KVGRAPH_HUGE_PAGES", raising=False)
    big = zeros([40 << 18])  # 40 MB, past the 32 MB chunks
    assert big.data_ptr() % (2 << 20) == 0 and not big.any()
    after = zeros([16])  # the big chunk is full: a new one
    assert not big.data_ptr() <= after.data_ptr() < big.data_ptr() + big.numel() * 4
    big[-1] = 3.0
    assert float(big[-1]) == 3.0 and not after.any()


def test_a_pack_outlives_the_chunk_moving_on(zeros, monkeypatch):
    monkeypatch.delenv("KVGRAPH_HUGE_PAGES", raising=False)
    first = zeros([1024])
    first.copy_(torch.arange(1024, dtype=torch.float32))
    for _ in range(3):
        zeros([10 << 20])  # 40 MB each: new chunks, dropped at once
    assert torch.equal(first, torch.arange(1024, dtype=torch.float32))


def test_the_arena_is_advised_for_huge_pages(zeros, monkeypatch):
    monkeypatch.delenv("KVGRAPH_HUGE_PAGES", raising=False)
    if thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {thp_mode()!r} here")
    eligible = thp_eligible(zeros([256]).data_ptr())
    if eligible is None:
        pytest.skip("this kernel's /proc/self/smaps has no THPeligible")
    assert eligible is True


def test_huge_pages_off_gives_atens_allocation(zeros, monkeypatch):
    monkeypatch.setenv("KVGRAPH_HUGE_PAGES", "0")
    a = zeros([3, 5])
    b = zeros([3, 5])
    assert not a.any() and a.shape == (3, 5)
    assert not (a.data_ptr() % PAGE == 0 and b.data_ptr() == a.data_ptr() + PAGE)
