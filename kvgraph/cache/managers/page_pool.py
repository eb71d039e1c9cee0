"""The page pool: allocates, frees, evicts and hashes pages (the middle layer, no tensors).

Prefix caching identifies a full page by a hash chained through its parent page's
hash, so equal tokens after different prefixes never match. A page freed with a hash
stays in the free queue, reusable by a later match, until allocation evicts it (least
recently freed first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvgraph.cache.managers.page_queue import FreePageQueue, Page

ROOT_HASH = b""
"""Parent hash of a sequence's first page."""


def page_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """Chained hash of a full page: 128-bit BLAKE2b of the parent hash and the page's token ids."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixMatch:
    """Cached pages that serve the start of a prompt.

    ``pages`` hold whole pages of the prompt (their chain ``hashes`` alongside); ``partial``,
    if set, is a cached page whose first ``partial_len`` tokens equal the prompt's next ones.
    It is shared, so the sequence gets a copy of it (copy-on-write) rather than the page.
    """

    pages: list[Page] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    partial: Page | None = None
    partial_len: int = 0

    def num_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + self.partial_len


class PagePool:
    """``num_pages`` pages, their ref counts, the LRU free queue and the prefix-hash index."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_queue = FreePageQueue(self.pages)
        # block_hash -> the page that holds it
        self._cached: dict[bytes, Page] = {}
        # parent_hash -> {page_id: cached page whose parent is that hash}
        self._children: dict[bytes, dict[int, Page]] = {}

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free(self) -> int:
        """Pages with no holder, cached or not: what allocation can take."""
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[Page]:
        """``n`` pages with ``ref_count == 1``, evicting the least recently freed first."""
        assert n <= self.num_free, f"allocate({n}) with {self.num_free} free pages"
        out = []
        for _ in range(n):
            page = self.free_queue.popleft()
            self._evict(page)
            page.ref_count = 1
            out.append(page)
        return out

    def touch(self, pages: Iterable[Page]) -> None:
        """Add a holder to each of ``pages`` (cached pages being reused), taking free ones off the queue."""
        for page in pages:
            if page.ref_count == 0:
                self.free_queue.remove(page)
            page.ref_count += 1

    def free(self, pages: Iterable[Page]) -> None:
        """Drop a holder from each of ``pages``, in order. A page left with none joins the free
        queue: at the tail if it caches a prefix (kept longest), else at the head.
        Pass a sequence's pages last-first so that the tail of a chain is evicted first."""
        for page in pages:
            assert page.ref_count > 0, f"free of {page}, which has no holder"
            page.ref_count -= 1
            if page.ref_count == 0:
                if page.block_hash is None:
                    self.free_queue.appendleft(page)
                else:
                    self.free_queue.append(page)

    def register(self, page: Page, parent_hash: bytes, tokens: Sequence[int]) -> bytes:
        """Record that ``page`` holds the full page ``tokens`` after ``parent_hash``; return its hash.

        If another page already caches the same hash, ``page`` stays unhashed (one page per hash).
        """
        assert page.block_hash is None, f"{page} is hashed already; a page's hash is set once"
        assert len(tokens) == self.page_size, f"register of {len(tokens)} tokens, page_size={self.page_size}"
        h = page_hash(parent_hash, tokens)
        if h not in self._cached:
            page.block_hash, page.parent_hash, page.tokens = h, parent_hash, tuple(tokens)
            self._cached[h] = page
            self._children.setdefault(parent_hash, {})[page.page_id] = page
        return h

    def match(self, tokens: Sequence[int], limit: int) -> PrefixMatch:
        """The cached pages that serve the longest start of ``tokens``, at most ``limit`` tokens:
        whole pages by chained hash, then the best partial page among the next page's candidates."""
        P = self.page_size
        m = PrefixMatch()
        parent = ROOT_HASH
        while (len(m.pages) + 1) * P <= limit:
            start = len(m.pages) * P
            chunk = tuple(tokens[start : start + P])
            h = page_hash(parent, chunk)
            page = self._cached.get(h)
            if page is None or page.tokens != chunk or page.parent_hash != parent:
                break
            m.pages.append(page)
            m.hashes.append(h)
            parent = h
        start = len(m.pages) * P
        want = tuple(tokens[start : min(limit, start + P)])
        for page in self._children.get(parent, {}).values():
            n = _common_prefix(page.tokens, want)
            if n > m.partial_len:
                m.partial, m.partial_len = page, n
        return m

    def forget_free(self) -> int:
        """Forget the cached contents of every page no sequence holds; return how many were forgotten.

        Pages held by a sequence keep their hashes. With nothing running afterwards, no later
        ``match`` finds anything that was computed before."""
        free = [page for page in self.pages if page.ref_count == 0 and page.block_hash is not None]
        for page in free:
            self._evict(page)
        return len(free)

    def _evict(self, page: Page) -> None:
        """Forget ``page``'s cached contents (it is being reallocated)."""
        if page.block_hash is None:
            return
        del self._cached[page.block_hash]
        siblings = self._children[page.parent_hash]
        del siblings[page.page_id]
        if not siblings:
            del self._children[page.parent_hash]
        page.block_hash, page.parent_hash, page.tokens = None, None, ()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
