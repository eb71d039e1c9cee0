"""Build the manager that matches ``params.cache_strategy`` (MAX's ``load_kv_manager``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.managers.continuous import ContinuousBatchingKVCacheManager
from kvgraph.cache.managers.paged import PagedKVCacheManager
from kvgraph.cache.params import KVCacheParams, KVCacheStrategy, check_positive_int
from kvgraph.errors import InvalidParamsError


def load_kv_manager(
    params: KVCacheParams,
    max_batch_size: int,
    max_seq_len: int,
    num_layers: int | None = None,
    devices: Sequence[torch.device | str] | None = None,
    session: object | None = None,
    available_cache_memory: int | None = None,
    *,
    num_pages: int | None = None,
) -> KVCacheManager:
    """A ``ContinuousBatchingKVCacheManager`` or a ``PagedKVCacheManager`` per ``params.cache_strategy``.

    The paged pool holds ``available_cache_memory`` bytes (over all devices) or ``num_pages``
    pages; with neither, ``max_batch_size`` sequences of ``max_seq_len`` tokens. The continuous
    cache always takes ``max_batch_size`` slots, so it takes neither.
    """
    check_positive_int("max_batch_size", max_batch_size)
    check_positive_int("max_seq_len", max_seq_len)
    args = (params, max_batch_size, max_seq_len, num_layers, devices, session)
    if params.cache_strategy is KVCacheStrategy.CONTINUOUS:
        if num_pages is not None:
            raise InvalidParamsError(f"num_pages={num_pages!r} needs cache_strategy=paged, got continuous")
        return ContinuousBatchingKVCacheManager(*args)
    if available_cache_memory is None and num_pages is None:
        num_pages = max_batch_size * -(-max_seq_len // params.page_size)
    return PagedKVCacheManager(*args, available_cache_memory, num_pages=num_pages)
