"""Spawning ranks ``1 .. N-1`` for rank 0, and what each of them runs.

Rank 0 hosts a ``TCPStore`` on the loopback interface, spawns one process per other rank and
waits until each reports that it reached the rendezvous (a rank that dies on the way is named
at once instead of after the timeout); then all of them initialise the default process group
over that store. A spawned rank builds the same ``LLM`` as rank 0 (the model travels in the
spawn arguments, the other ``LLM`` arguments with it), which shards its copy of the model,
then serves rank 0's steps until rank 0 stops it, and exits.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from kvgraph.errors import KVCacheError, RankFailedError

LOOPBACK = "127.0.0.1"
STORE_PREFIX = "kvgraph/pg/"


def spawn_workers(
    model: nn.Module, world_size: int, device: torch.device, engine_args: dict, timeout: timedelta
) -> list[mp.Process]:
    """Spawn ranks ``1 .. world_size - 1`` and initialise the default process group as rank 0."""
    from kvgraph.parallel.group import backend_for, describe_exit

    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    workers = []
    for rank in range(1, world_size):
        process = ctx.Process(
            target=worker_main, name=f"kvgraph-rank-{rank}",
            args=(rank, world_size, store.port, model, engine_args, timeout.total_seconds(), ready),
        )
        process.start()
        workers.append(process)
    waiting, deadline = set(range(1, world_size)), time.monotonic() + timeout.total_seconds()
    while waiting:
        try:
            waiting.discard(ready.get(timeout=0.5))
        except queue.Empty:
            dead = [(i + 1, p) for i, p in enumerate(workers) if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                for p in workers:
                    p.kill()
                    p.join()
                why = "; ".join(f"rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}" for r, p in dead)
                raise RankFailedError(
                    f"the tensor-parallel group did not form: {why or f'ranks {sorted(waiting)} timed out'}"
                ) from None
    dist.init_process_group(
        backend_for(device), store=dist.PrefixStore(STORE_PREFIX, store), rank=0, world_size=world_size,
        timeout=timeout,
    )
    return workers


def worker_main(
    rank: int, world_size: int, port: int, model: nn.Module, engine_args: dict, timeout_s: float,
    ready,
) -> None:
    """A spawned rank: join the group, build the engine (which serves rank 0 until it stops), exit.

    Exits with status 1 and one line on stderr naming this rank when the group fails.
    """
    from kvgraph.engine.llm_engine import LLM
    from kvgraph.engine.loading import resolve_device
    from kvgraph.parallel.group import backend_for

    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    timeout = timedelta(seconds=timeout_s)
    device = resolve_device(engine_args.get("device"))
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    ready.put(rank)
    dist.init_process_group(
        backend_for(device), store=dist.PrefixStore(STORE_PREFIX, store), rank=rank,
        world_size=world_size, timeout=timeout,
    )
    try:
        LLM(model, **{**engine_args, "progress": False}, tensor_parallel_size=world_size)
    except (RankFailedError, KVCacheError) as e:
        sys.stderr.write(f"kvgraph rank {rank}: {e}\n")
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
