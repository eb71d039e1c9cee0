"""The sharding plan: which linear layers of a decoder split by output (colwise) or by input (rowwise).

Megatron-style tensor parallelism over ``N`` ranks, applied with PyTorch's own
``torch.distributed.tensor.parallel.parallelize_module``:

- attention: ``q_proj``, ``k_proj``, ``v_proj`` colwise (each rank computes ``Hq/N`` query and
  ``Hkv/N`` KV heads, whole heads since the split is by output rows), ``o_proj`` rowwise (each
  rank's partial sum of the output projection, then an all-reduce);
- MLP: ``gate_proj``, ``up_proj`` colwise, ``down_proj`` rowwise (one all-reduce);
- everything else (embeddings, norms, the vocabulary projection) is replicated.

So each decoder layer costs two all-reduces of ``[T, hidden]``, which ``RowwiseParallel`` emits
as functional collectives Dynamo traces into the graph. The attention code itself is not
touched: Hugging Face attention reshapes with ``-1`` heads, so the captured graph sees ``Hq/N``
and ``Hkv/N`` heads and kvgraph lowers it onto a cache of ``Hkv/N`` heads.

The plan is read off the module structure by the projection names of the Llama family (Llama,
Qwen2, Mistral, ...). Modules that fuse Q, K and V into one projection (GPT-2's ``c_attn``,
nanoGPT) would need their fused output regrouped per rank and the head count in their reshapes
changed, which no module-level plan can express: they are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kvgraph.errors import InvalidParamsError
from kvgraph.params import KVCacheParams

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
FUSED = ("c_attn", "qkv_proj", "W_pack", "query_key_value", "Wqkv", "gate_up_proj")


@dataclass(frozen=True)
class ShardingPlan:
    """Module names (``model.named_modules()``) split colwise and rowwise over ``world_size`` ranks.

    Attributes:
        colwise: ``nn.Linear`` modules whose output features (weight rows, bias) are split.
        rowwise: ``nn.Linear`` modules whose input features (weight columns) are split; their
            outputs are all-reduced (the bias is added once).
        world_size: ranks the plan splits over.
        n_heads: query heads of the model (``q_proj.out_features / head_dim``).
        n_kv_heads: KV heads of the model.
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    world_size: int
    n_heads: int
    n_kv_heads: int

    @classmethod
    def of(cls, model: nn.Module, world_size: int, params: KVCacheParams) -> ShardingPlan:
        """The plan of ``model`` over ``world_size`` ranks; ``InvalidParamsError`` when the model
        has no splittable projections or a size (heads, MLP width) does not divide."""
        colwise, rowwise, uneven = [], [], []
        n_heads = None
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in FUSED:
                raise InvalidParamsError(
                    f"tensor parallelism cannot split {name!r}: it fuses several projections into one "
                    f"output; supported are separate {', '.join(COLWISE[:3])} and {ROWWISE[0]} "
                    f"(the Llama family: Llama, Qwen2, Mistral)"
                )
            if leaf not in COLWISE + ROWWISE:
                continue
            if not isinstance(module, nn.Linear):
                raise InvalidParamsError(
                    f"tensor parallelism splits nn.Linear layers; {name!r} is a {type(module).__name__}"
                )
            size = module.out_features if leaf in COLWISE else module.in_features
            if size % world_size:
                uneven.append(f"the {size} {'output' if leaf in COLWISE else 'input'} features of {name!r}")
            (colwise if leaf in COLWISE else rowwise).append(name)
            if leaf == "q_proj" and n_heads is None:
                n_heads = module.out_features // params.head_dim
        if n_heads is None or not rowwise:
            raise InvalidParamsError(
                f"tensor parallelism found no q_proj/k_proj/v_proj/o_proj projections in "
                f"{type(model).__name__}: nothing to split over {world_size} ranks"
            )
        plan = cls(tuple(colwise), tuple(rowwise), world_size, n_heads, params.n_kv_heads)
        plan.check_heads()
        if uneven:
            raise InvalidParamsError(f"tensor_parallel_size={world_size} does not divide {uneven[0]}")
        return plan

    def check_heads(self) -> None:
        """``InvalidParamsError`` unless query and KV heads split evenly over the ranks."""
        for what, count in (("query heads", self.n_heads), ("KV heads", self.n_kv_heads)):
            if count % self.world_size:
                raise InvalidParamsError(
                    f"tensor_parallel_size={self.world_size} does not divide the model's {count} {what} "
                    f"({self.n_heads} query / {self.n_kv_heads} KV heads): every rank needs whole heads"
                )

    def local_params(self, params: KVCacheParams, device: torch.device) -> KVCacheParams:
        """The cache of one rank: ``n_kv_heads / world_size`` heads of every token, on ``device``."""
        return replace(params, n_kv_heads=params.n_kv_heads // self.world_size, device=device)

    def apply(self, model: nn.Module, mesh: torch.distributed.device_mesh.DeviceMesh) -> nn.Module:
        """Shard ``model`` in place over ``mesh`` (a 1-D mesh of ``world_size`` ranks)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {name: ColwiseParallel() for name in self.colwise}
        styles.update({name: RowwiseParallel() for name in self.rowwise})
        return parallelize_module(model, mesh, styles)
