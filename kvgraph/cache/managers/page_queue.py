"""Page metadata and the free list of the paged cache: the bottom layer, no tensors."""

from __future__ import annotations

from collections.abc import Iterator


class Page:
    """Metadata of one physical page of the cache.

    ``ref_count`` counts the sequences whose lookup rows hold the page. A page with a
    ``block_hash`` holds a full page of committed tokens that a later prompt may reuse;
    its ``tokens`` and ``parent_hash`` verify a match (a hash collision never serves the
    wrong contents). ``prev``/``next`` link the page into the free queue while
    ``ref_count == 0``.
    """

    __slots__ = ("page_id", "ref_count", "block_hash", "parent_hash", "tokens", "prev", "next")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.tokens: tuple[int, ...] = ()
        self.prev: Page | None = None
        self.next: Page | None = None

    def __repr__(self) -> str:
        return f"Page({self.page_id}, ref={self.ref_count}, hash={self.block_hash})"


class FreePageQueue:
    """Doubly linked list of free pages, O(1) at both ends and for removal from the middle.

    Allocation pops the head; the head is the least recently freed page, so popping it
    evicts in LRU order. Freed pages that cache a prefix join at the tail (kept longest);
    freed pages with nothing reusable join at the head (reused first).
    """

    def __init__(self, pages: list[Page]) -> None:
        self._head = Page(-1)  # sentinels
        self._tail = Page(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Page]:
        """Pages from the head (evicted first) to the tail."""
        page = self._head.next
        while page is not self._tail:
            yield page
            page = page.next

    def popleft(self) -> Page:
        page = self._head.next
        assert page is not self._tail, "popleft from an empty free queue"
        self.remove(page)
        return page

    def append(self, page: Page) -> None:
        self._link(page, self._tail.prev, self._tail)

    def appendleft(self, page: Page) -> None:
        self._link(page, self._head, self._head.next)

    def remove(self, page: Page) -> None:
        assert page.prev is not None and page.next is not None, f"{page} is not in the free queue"
        page.prev.next = page.next
        page.next.prev = page.prev
        page.prev = page.next = None
        self._len -= 1

    def _link(self, page: Page, before: Page, after: Page) -> None:
        assert page.prev is None and page.next is None, f"{page} is already in the free queue"
        page.prev, page.next = before, after
        before.next = page
        after.prev = page
        self._len += 1
