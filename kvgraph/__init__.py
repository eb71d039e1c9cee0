"""kvgraph: a MAX-style paged KV cache for the PyTorch compiler stack.

Public names are imported lazily so that ``import kvgraph`` stays cheap and
light parts (params, managers) do not pull in the compiler stack.
"""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

_IMPORT_NOISE = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported",
}
"""Warnings dropped from these loggers (by the start of their message): transformers imports torchao
(the ``quant`` extra) whenever it is installed, which then says that its CUDA kernels do not load
on a CPU-only torch and calls an Enum registration torch has deprecated, on every run."""


def _drop_import_noise(record: logging.LogRecord) -> bool:
    start = _IMPORT_NOISE.get(record.name)
    return start is None or not str(record.msg).startswith(start)


for _name in _IMPORT_NOISE:
    logging.getLogger(_name).addFilter(_drop_import_noise)

_EXPORTS = {
    "kvgraph.errors": [
        "KVGraphError", "ConfigError", "KVCacheError", "InvalidParamsError", "UnknownSequenceError", "DuplicateSequenceError",
        "NoFreeSlotsError", "BatchSizeError", "BatchTypeError", "SequenceLengthError", "CacheInputError",
        "StepError", "OutOfPagesError", "BindingError", "LoweringError", "WindowNotShownError", "RankFailedError",
        "CppKernelError", "EngineFailure", "WarmCacheError", "MissingExtraError",
    ],
    "kvgraph.cache.params": ["KVCacheParams", "KVCacheStrategy"],
    "kvgraph.cache.quant": ["KVCacheQuantizationConfig"],
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
