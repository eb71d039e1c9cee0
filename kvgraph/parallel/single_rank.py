"""One rank of a tensor-parallel model in this process alone, for looking at its graph.

``kvgraph dump --tensor-parallel-size N`` shows what rank 0 compiles: the model split by the
plan, its attention over ``Hq/N`` query and ``Hkv/N`` KV heads, and the all-reduces. No other
rank is needed to trace and run the graph once: a fake process group (PyTorch's ``fake``
backend, whose collectives return their input) stands in for them, so the numbers of such a
run are not the model's, only the graph is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from kvgraph.cache.params import KVCacheParams
from kvgraph.parallel.plan import ShardingPlan


def shard_as_rank_zero(model: nn.Module, world_size: int, params: KVCacheParams) -> KVCacheParams:
    """Split ``model`` in place as rank 0 of ``world_size`` ranks over a fake process group;
    returns rank 0's cache params. ``ConfigError`` or ``LoweringError`` when the model does not split."""
    from torch.distributed.device_mesh import init_device_mesh

    plan = ShardingPlan.of(model, world_size, params)
    if not dist.is_initialized():
        _register_fake_backend()
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    plan.apply(model, init_device_mesh(params.device.type, (world_size,)))
    return plan.local_params(params, params.device)


def _register_fake_backend() -> None:
    """Register c10d's ``FakeProcessGroup`` as the ``fake`` backend unless it is already (PyTorch
    registers it only when its test helpers are imported; the store is never used by it)."""
    if dist.Backend.FAKE in dist.Backend.backend_list:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, options):
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend(dist.Backend.FAKE, create, extended_api=True, devices=["cpu", "cuda"])


REDUCE_OPS = (torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.all_reduce.default)
"""How a functional all-reduce appears: the packet in a captured graph, the overload after AOTAutograd."""


def all_reduces(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of a captured (or lowered) graph that all-reduce the rowwise layers' partial sums:
    DTensor ``redistribute`` calls from a ``Partial`` placement to a ``Replicate`` one (the Llama
    plan; AOTAutograd turns each into ``_c10d_functional.all_reduce`` followed by ``wait_tensor``),
    and ``_c10d_functional.all_reduce`` calls themselves (the fused-QKV plan's hooks)."""
    from torch.distributed.tensor import DTensor

    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in REDUCE_OPS:
            found.append(node)
        elif node.op == "call_method" and node.target == "redistribute":
            source = node.args[0].meta.get("example_value") if isinstance(node.args[0], torch.fx.Node) else None
            result = node.meta.get("example_value")
            if isinstance(source, DTensor) and isinstance(result, DTensor) and any(
                p.is_partial() for p in source.placements
            ) and all(p.is_replicate() for p in result.placements):
                found.append(node)
    return found
