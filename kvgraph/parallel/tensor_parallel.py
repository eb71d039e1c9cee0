"""Tensor parallelism as a runner strategy: the engine on rank 0, :func:`run_worker` on the others.

Rank 0 builds the engine with a :class:`TensorParallelStrategy`; the strategy forms or joins the
group when the engine shards its model, and spawns the other ranks when no ``torchrun`` or process
group set them up. Every other rank runs :func:`run_worker` with the same ``EngineConfig``: the same
model, sharded the same way and compiled against its own part of the cache, repeating rank 0's
model calls until rank 0 closes its engine. No rank but 0 builds an engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.params import KVCacheParams
from kvgraph.engine.config import EngineConfig
from kvgraph.engine.loading import load_model
from kvgraph.engine.progress import CompileProgress
from kvgraph.engine.runner import ModelRunner
from kvgraph.engine.strategy import prepare_model
from kvgraph.parallel.group import TensorParallel, local_device
from kvgraph.parallel.runner import DriverRunner, WorkerRunner


class TensorParallelStrategy:
    """A ``RunnerStrategy`` over ``world_size`` ranks, as this process's rank.

    Attributes:
        world_size: ranks the model is split over.
        group: this process's place in the group, once :meth:`shard` formed or joined it.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group: TensorParallel | None = None

    def device(self, device: torch.device) -> torch.device:
        """The CPU, or ``cuda:LOCAL_RANK``."""
        return local_device(device, self.world_size)

    def shard(self, model: nn.Module, params: KVCacheParams, config: EngineConfig) -> KVCacheParams:
        """Check the plan, form or join the group (spawned ranks run :func:`run_worker` with
        ``config`` and ``model`` as it is now, unsharded), split ``model`` in place; returns this
        rank's cache params (``n_kv_heads / world_size`` heads)."""
        self.group = TensorParallel.start(
            model, self.world_size, params, params.device, functools.partial(run_worker, config, model)
        )
        return self.group.local_params(params)

    def runner(
        self, compiled: Callable, manager: KVCacheManager, progress: CompileProgress | None
    ) -> ModelRunner:
        """Rank 0's ``DriverRunner`` (publishes each call) or another rank's ``WorkerRunner``."""
        runner = DriverRunner if self.group.is_driver else WorkerRunner
        return runner(compiled, manager, self.group, progress)

    def close(self) -> None:
        """Stop the other ranks (rank 0) and leave the group."""
        if self.group is not None:
            self.group.close()


def run_worker(config: EngineConfig, model: nn.Module | str | Path) -> int:
    """Run a rank other than 0 of a tensor-parallel engine: load ``model`` (a module, a preset name or
    a checkpoint directory, as ``kvgraph.LLM`` takes it), take this rank's shard, compile it, then
    repeat rank 0's model calls until rank 0 closes its engine. Returns how many calls ran.

    The process is in the group already (spawned by rank 0, started by ``torchrun``, or given an
    initialised process group). Compiles silently: rank 0 shows the progress.
    """
    module, _ = load_model(model, trust_remote_code=config.trust_remote_code)
    strategy = TensorParallelStrategy(config.tensor_parallel_size)
    prepared = prepare_model(module, replace(config, progress=False), strategy)
    calls = prepared.runner.serve()
    strategy.close()
    return calls
