"""KV cache managers: continuous batching (a slot per sequence) and paged (with prefix caching)."""

from kvgraph.managers.base import KVCacheManager, ragged_input_symbols
from kvgraph.managers.continuous import ContinuousBatchingKVCacheManager
from kvgraph.managers.factory import load_kv_manager
from kvgraph.managers.paged import PagedKVCacheManager

__all__ = [
    "ContinuousBatchingKVCacheManager",
    "KVCacheManager",
    "PagedKVCacheManager",
    "load_kv_manager",
    "ragged_input_symbols",
]
