"""How the engine runs its model: a runner strategy places, shards and runs it.

The engine is handed a strategy and never asks how many processes take part:
:class:`SingleProcess` (the default) runs the whole model here; tensor parallelism
(``kvgraph.parallel``) runs this process's shard and has the other ranks repeat each call.
:func:`prepare_model` is the one sequence both the engine and a tensor-parallel worker rank go
through: device, cache params, shard, manager, compile, runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.engine.background_compile import CompileWorker, CompilingInBackground
from kvgraph.engine.config import EngineConfig, resolve_freeze_weights
from kvgraph.engine.loading import make_manager, model_dtype, model_kv_params
from kvgraph.engine.progress import CompileProgress
from kvgraph.engine.quantization import quantize
from kvgraph.engine.runner import ModelRunner

if TYPE_CHECKING:
    from kvgraph.compiler.backend import CompiledModel


class RunnerStrategy(Protocol):
    """Where the model runs and who takes part in each call; :func:`prepare_model` calls the
    methods in the order they are listed, then the engine calls ``close`` once it stops."""

    world_size: int
    """Processes that run each model call (``EngineConfig.tensor_parallel_size``)."""

    def device(self, device: torch.device) -> torch.device:
        """This process's device, given the configured one (a rank picks its own GPU)."""
        ...

    def shard(self, model: nn.Module, params: KVCacheParams, config: EngineConfig) -> KVCacheParams:
        """Make ``model`` (on this process's device) this process's part of it, in place; returns
        the params of this process's cache, given those of the whole model's."""
        ...

    def runner(
        self, compiled: Callable, manager: KVCacheManager, progress: CompileProgress | None
    ) -> ModelRunner:
        """The runner of ``compiled`` (lowered against ``manager``); ``progress`` shows compiles."""
        ...

    def close(self) -> None:
        """Release what the strategy started (other processes, a process group); safe to call twice."""
        ...


class SingleProcess:
    """The whole model in this process: nothing to shard, a plain :class:`ModelRunner`."""

    world_size = 1

    def device(self, device: torch.device) -> torch.device:
        return device

    def shard(self, model: nn.Module, params: KVCacheParams, config: EngineConfig) -> KVCacheParams:
        return params

    def runner(
        self, compiled: Callable, manager: KVCacheManager, progress: CompileProgress | None
    ) -> ModelRunner:
        return ModelRunner(compiled, progress)

    def close(self) -> None:
        return None


@dataclass
class PreparedModel:
    """A model ready to serve steps: on its device, shard taken, compiled against its cache.

    Attributes:
        model: the module (this process's shard of it), in eval mode.
        device: where it runs.
        params: this process's cache params.
        manager: this process's KV cache manager.
        compiled: the ``kvgraph.compile`` result the runner calls (a ``CompilingInBackground`` around
            it while a compile worker runs).
        runner: runs one ragged batch (``ModelRunner``, or a strategy's subclass).
    """

    model: nn.Module
    device: torch.device
    params: KVCacheParams
    manager: KVCacheManager
    compiled: CompiledModel | CompilingInBackground
    runner: ModelRunner


def prepare_model(model: nn.Module, config: EngineConfig, strategy: RunnerStrategy) -> PreparedModel:
    """Place ``model`` with ``strategy``, quantize its weights (``config.quantization``), read its
    cache params, shard it, build its manager (``config.kv_cache_memory`` split over the ranks) and
    compile it as ``config`` says.

    The compiler stack is imported here, with the first engine, so that importing
    ``kvgraph.engine`` (the CLI's flags read ``EngineConfig``) stays light."""
    from kvgraph.compiler import backend

    device = strategy.device(config.device)
    model = model.to(device=device, dtype=config.dtype).eval()
    if config.quantization is not None:
        model = quantize(model, config.quantization, lm_head=config.quantize_lm_head)
    params = model_kv_params(
        model, cache_strategy=config.cache_strategy, page_size=config.page_size,
        enable_prefix_caching=config.enable_prefix_caching, device=device, kv_cache_dtype=config.kv_cache_dtype,
    )
    params = strategy.shard(model, params, config)
    manager = make_manager(params, config.max_batch_size, config.max_seq_len, config.kv_cache_memory_per_rank)
    shown = CompileProgress(config.compile) if config.progress else None
    frozen = resolve_freeze_weights(config, model_dtype(model), device)
    precompile = config.precompile and config.compile == "inductor" and not frozen and strategy.world_size == 1
    compiled = backend.compile(
        model, manager=manager, inner=config.compile, packed_linears=config.packed_linears,
        freeze_weights=frozen, dump=shown.dump if shown else None, precompile=precompile,
        cpp_wrapper=config.cpp_wrapper,
    )
    if precompile and config.background_compile and not (compiled.has_precompiled(False)
                                                          and compiled.has_precompiled(True)):
        eager = backend.compile(
            model, manager=manager, inner="eager", packed_linears=config.packed_linears,
            freeze_weights=False, dump=shown.dump if shown else None,
        )
        if shown is not None:
            shown.inner = "eager"  # what this process runs until the worker is done
        compiled = CompilingInBackground(eager, compiled, CompileWorker(model, config), progress=shown)
    return PreparedModel(model, device, params, manager, compiled, strategy.runner(compiled, manager, shown))
