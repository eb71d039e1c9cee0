"""The tensor-parallel group of one engine: its ranks, process group, plan, channel and lifetime.

``TensorParallel.start`` is how every rank of ``kvgraph.LLM(..., tensor_parallel_size=N)`` joins
or forms a group of ``N`` ranks, in one of three ways:

- a process group already exists (the caller initialised one, or this is a spawned worker):
  it is used as it is;
- ``torchrun`` set ``RANK``/``WORLD_SIZE`` (and the rendezvous variables): the default process
  group is initialised from the environment (``env://``), so several hosts work the same;
- neither: this process becomes rank 0 and spawns ranks ``1 .. N-1`` (``torch.multiprocessing``,
  spawn), which rendezvous over a ``TCPStore`` on the loopback interface.

Backend: gloo on the CPU, NCCL on CUDA (rank ``r`` uses ``cuda:LOCAL_RANK``). Every collective
and the rendezvous time out after ``KVGRAPH_TP_TIMEOUT`` seconds (default 600).
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from kvgraph.cache.params import KVCacheParams
from kvgraph.errors import BindingError, ConfigError, LoweringError, RankFailedError
from kvgraph.parallel.channel import STOP, StepChannel
from kvgraph.parallel.plan import ShardingPlan
from kvgraph.parallel.spawn import backend_for, describe_exit, spawn_workers

TIMEOUT_ENV = "KVGRAPH_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 30.0


def collective_timeout() -> timedelta:
    """The timeout of every collective and of the rendezvous (``KVGRAPH_TP_TIMEOUT`` seconds)."""
    text = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def local_device(device: torch.device, world_size: int) -> torch.device:
    """This rank's device: the CPU, or ``cuda:LOCAL_RANK``. ``ConfigError`` (before any
    process starts) when a host runs more ranks than it has GPUs."""
    if device.type != "cuda":
        return device
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    have = torch.cuda.device_count()
    if ranks_here > have:
        raise ConfigError(
            f"tensor_parallel_size={world_size} puts {ranks_here} ranks on this host, which has {have} "
            f"CUDA device(s): each rank needs a GPU of its own"
        )
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def launched_rank() -> int:
    """This process's rank in a group set up before kvgraph forms one: the default process group's,
    else the ``RANK`` that ``torchrun`` set; 0 when there is neither (this process will be rank 0
    and spawn the others)."""
    if dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return 0


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: 0 owns the scheduler and the API; the others repeat its steps.
        world_size: ranks in the group (``tensor_parallel_size``).
        device: this rank's device.
        plan: how the model is split.
        channel: the step messages from rank 0.
        workers: the processes this rank spawned (rank 0 without ``torchrun``), rank ``i + 1`` at ``i``.
        owns_group: whether ``close`` destroys the default process group (this object created it).
        failure: why the group stopped working, once a rank failed.
    """

    rank: int
    world_size: int
    device: torch.device
    plan: ShardingPlan
    channel: StepChannel
    workers: list[mp.Process] = field(default_factory=list)
    owns_group: bool = False
    failure: str | None = None
    closed: bool = False

    @classmethod
    def start(
        cls,
        model: nn.Module,
        world_size: int,
        params: KVCacheParams,
        device: torch.device,
        worker_main: Callable[[], object],
    ) -> TensorParallel:
        """Check the plan, form or join the group, and shard ``model`` in place.

        ``worker_main`` is what each rank this process spawns runs once it joined the group (see
        :func:`~kvgraph.parallel.spawn.spawn_workers`). Raises ``ConfigError`` before any
        process starts when a size does not divide; ``RankFailedError`` when a spawned rank dies
        before the group forms.
        """
        plan = ShardingPlan.of(model, world_size, params)
        timeout = collective_timeout()
        workers: list[mp.Process] = []
        owns = False
        if not dist.is_initialized():
            owns = True
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend_for(device), timeout=timeout)
            else:
                workers = spawn_workers(worker_main, world_size, device, timeout)
        if dist.get_world_size() != world_size:
            raise ConfigError(
                f"tensor_parallel_size={world_size}, but the process group has {dist.get_world_size()} ranks"
            )
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
        from torch.distributed.device_mesh import init_device_mesh

        plan.apply(model, init_device_mesh(device.type, (world_size,)))
        store = dist.distributed_c10d._get_default_store()
        tp = cls(dist.get_rank(), world_size, device, plan, StepChannel(store, timeout), workers, owns)
        atexit.register(tp.close)
        return tp

    @property
    def is_driver(self) -> bool:
        """Rank 0: owns the scheduler, the manager's bookkeeping and the API."""
        return self.rank == 0

    def local_params(self, params: KVCacheParams) -> KVCacheParams:
        """This rank's cache: ``n_kv_heads / world_size`` heads on this rank's device."""
        return self.plan.local_params(params, self.device)

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Run a step's collectives; a failure becomes ``RankFailedError`` naming the rank that
        died when one did, and shuts the group down (later steps raise the same error)."""
        if self.failure is not None:
            raise RankFailedError(self.failure)
        try:
            yield
        except (BindingError, LoweringError, RankFailedError):
            raise
        except RuntimeError as e:
            self.failure = f"rank {self.rank}: {what} failed: {self._culprit()}: {e}"
            self._stop_workers()
            raise RankFailedError(self.failure) from e

    def _culprit(self) -> str:
        """Which spawned ranks are dead, or that the failing rank is not known here."""
        for process in self.workers:
            process.join(timeout=1.0)
        dead = [
            f"rank {i + 1} (pid {p.pid}) {describe_exit(p.exitcode)}"
            for i, p in enumerate(self.workers) if p.exitcode is not None
        ]
        return "; ".join(dead) if dead else "a collective with another rank failed or timed out"

    def close(self) -> None:
        """Stop the other ranks (rank 0) and release the group; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.is_driver and self.failure is None:
            with contextlib.suppress(RuntimeError):
                self.channel.publish(STOP)
        self._stop_workers()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)

    def _stop_workers(self) -> None:
        """Join the spawned ranks; terminate (then kill) any that do not exit in time."""
        for process in self.workers:
            process.join(timeout=JOIN_TIMEOUT_S if self.failure is None else 1.0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
