"""Spawning ranks ``1 .. N-1`` for rank 0, and their way into the group.

Rank 0 hosts a ``TCPStore`` on the loopback interface, spawns one process per other rank and
waits until each reports that it reached the rendezvous (a rank that dies on the way is named
at once instead of after the timeout); then all of them initialise the default process group
over that store. A spawned rank then runs the function rank 0 gave it (the model travels in it),
and exits.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvgraph.errors import KVGraphError, RankFailedError

LOOPBACK = "127.0.0.1"
STORE_PREFIX = "kvgraph/pg/"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def describe_exit(code: int | None) -> str:
    """``exited with status 1`` / ``was killed by SIGKILL`` / ``is running``."""
    if code is None:
        return "is running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def spawn_workers(
    main: Callable[[], object], world_size: int, device: torch.device, timeout: timedelta
) -> list[mp.Process]:
    """Spawn ranks ``1 .. world_size - 1``, each running ``main()`` once it joined the group (``main``
    is pickled: a top-level function or a ``functools.partial`` of one), and initialise the default
    process group as rank 0."""
    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    workers = []
    for rank in range(1, world_size):
        process = ctx.Process(
            target=rank_main, name=f"kvgraph-rank-{rank}",
            args=(rank, world_size, store.port, device, timeout.total_seconds(), ready, main),
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


def rank_main(
    rank: int, world_size: int, port: int, device: torch.device, timeout_s: float, ready,
    main: Callable[[], object],
) -> None:
    """A spawned rank: join the group, run ``main()``, leave the group, exit.

    Exits with status 1 and one line on stderr naming this rank when the group or ``main`` fails
    with a kvgraph error.
    """
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    ready.put(rank)
    dist.init_process_group(
        backend_for(device), store=dist.PrefixStore(STORE_PREFIX, store), rank=rank,
        world_size=world_size, timeout=timeout,
    )
    try:
        main()
    except KVGraphError as e:
        sys.stderr.write(f"kvgraph rank {rank}: {e}\n")
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
