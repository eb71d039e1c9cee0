"""Tensor parallelism over ``torch.distributed``: one model and its KV cache split across ranks.

- ``tensor_parallel``: the runner strategy rank 0's engine is handed, and ``run_worker``, what
  every other rank runs;
- ``plan``: which linear layers split colwise / rowwise (``parallelize_module``), and the checks
  that every rank gets whole heads;
- ``fused``: models with one ``[q | k | v]`` projection (GPT-2, nanoGPT): weights regrouped per rank,
  the attention's sizes divided, an all-reduce after each rowwise layer;
- ``group``: forming or joining the group (spawned ranks, ``torchrun``, or an existing process
  group), timeouts, naming a rank that died, shutting down;
- ``spawn``: spawning ranks ``1 .. N-1`` and their rendezvous;
- ``channel``: rank 0's broadcast of each step's inputs;
- ``runner``: rank 0's runner that publishes each model call, the other ranks' runner that repeats it;
- ``single_rank``: rank 0's graph in one process, for ``kvgraph dump``.

``kvgraph.LLM(model, tensor_parallel_size=N)`` is the front door.
"""

from kvgraph.parallel.group import TensorParallel
from kvgraph.parallel.plan import ShardingPlan
from kvgraph.parallel.tensor_parallel import TensorParallelStrategy, run_worker

__all__ = ["ShardingPlan", "TensorParallel", "TensorParallelStrategy", "run_worker"]
