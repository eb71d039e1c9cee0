"""FreePageQueue: O(1) doubly linked free list in LRU order."""

import pytest

from kvgraph.cache.managers.page_queue import FreePageQueue, Page


def _ids(q):
    return [p.page_id for p in q]


def test_pops_in_insertion_order():
    pages = [Page(i) for i in range(4)]
    q = FreePageQueue(pages)
    assert len(q) == 4 and _ids(q) == [0, 1, 2, 3]
    assert q.popleft() is pages[0]
    assert _ids(q) == [1, 2, 3] and pages[0].prev is pages[0].next is None


def test_remove_from_middle_and_ends():
    pages = [Page(i) for i in range(5)]
    q = FreePageQueue(pages)
    q.remove(pages[2])
    q.remove(pages[0])
    q.remove(pages[4])
    assert _ids(q) == [1, 3] and len(q) == 2
    q.append(pages[2])
    q.appendleft(pages[0])
    assert _ids(q) == [0, 1, 3, 2]


def test_misuse_is_caught():
    pages = [Page(0), Page(1)]
    q = FreePageQueue(pages[:1])
    with pytest.raises(AssertionError, match="already in the free queue"):
        q.append(pages[0])
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(pages[1])
    q.popleft()
    with pytest.raises(AssertionError, match="empty"):
        q.popleft()
