"""kvgraph: a MAX-style paged KV cache for the PyTorch compiler stack.

Public names are imported lazily so that ``import kvgraph`` stays cheap and
light parts (params, managers) do not pull in the compiler stack.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "kvgraph.errors": [
        "KVGraphError", "ConfigError", "KVCacheError", "InvalidParamsError", "UnknownSequenceError", "DuplicateSequenceError",
        "NoFreeSlotsError", "BatchSizeError", "BatchTypeError", "SequenceLengthError", "CacheInputError",
        "StepError", "OutOfPagesError", "BindingError", "LoweringError", "WindowNotShownError", "RankFailedError",
        "CppKernelError", "EngineFailure", "WarmCacheError", "MissingExtraError",
    ],
    "kvgraph.cache.params": ["KVCacheParams", "KVCacheStrategy"],
    "kvgraph.cache.symbols": [
        "TensorType", "KVCacheInputSymbols", "RaggedKVCacheInputSymbols", "PaddedKVCacheInputSymbols",
        "ragged_input_symbols",
    ],
    "kvgraph.cache.inputs": [
        "KVCacheInputs", "RaggedKVCacheInputs", "PaddedKVCacheInputs", "KVCacheInputsSequence",
    ],
    "kvgraph.cache.request": ["KVRequest"],
    "kvgraph.cache.managers": [
        "KVCacheManager", "ContinuousBatchingKVCacheManager", "PagedKVCacheManager", "load_kv_manager",
    ],
    "kvgraph.cache.collection": [
        "ContinuousBatchingKVCacheCollection", "PagedKVCacheCollection",
        "ContinuousBatchingKVCache", "PagedKVCache", "collection_for",
    ],
    "kvgraph.compiler.runtime": ["bind"],
    "kvgraph.compiler.step": ["prepare_step", "run_step"],
    "kvgraph.compiler.backend": ["compile", "kvgraph_backend"],
    "kvgraph.engine": ["EngineConfig", "SamplingParams", "Completion"],
    "kvgraph.entrypoints.llm": ["LLM"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
