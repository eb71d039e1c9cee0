"""KV cache managers: continuous batching (a slot per sequence) and paged (with prefix caching)."""

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.managers.continuous import ContinuousBatchingKVCacheManager
from kvgraph.cache.managers.factory import load_kv_manager
from kvgraph.cache.managers.paged import PagedKVCacheManager

__all__ = [
    "ContinuousBatchingKVCacheManager",
    "KVCacheManager",
    "PagedKVCacheManager",
    "load_kv_manager",
]
