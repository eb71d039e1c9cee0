"""Build the manager that matches ``params.cache_strategy``."""

from __future__ import annotations

from typing import Any

from kvgraph.managers.base import KVCacheManager, check_positive_int
from kvgraph.managers.continuous import ContinuousBatchingKVCacheManager
from kvgraph.managers.paged import PagedKVCacheManager
from kvgraph.params import KVCacheParams, KVCacheStrategy


def load_kv_manager(
    params: KVCacheParams, max_batch_size: int, max_seq_len: int, **kwargs: Any
) -> KVCacheManager:
    """A ``ContinuousBatchingKVCacheManager`` or a ``PagedKVCacheManager`` per ``params.cache_strategy``.

    ``kwargs`` go to the paged manager (``num_pages=`` or ``cache_memory=``); with neither, the
    pool holds ``max_batch_size`` sequences of ``max_seq_len`` tokens. The continuous manager
    takes none.
    """
    check_positive_int("max_batch_size", max_batch_size)
    check_positive_int("max_seq_len", max_seq_len)
    if params.cache_strategy is KVCacheStrategy.CONTINUOUS:
        return ContinuousBatchingKVCacheManager(params, max_batch_size, max_seq_len, **kwargs)
    if not kwargs:
        pages_per_seq = -(-max_seq_len // params.page_size)
        kwargs = {"num_pages": max_batch_size * pages_per_seq}
    return PagedKVCacheManager(params, max_batch_size, max_seq_len, **kwargs)
