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
Qwen2, Mistral, ...), and of the GPT-2 family: a fused ``[q | k | v]`` projection ``c_attn`` with
its output projection ``c_proj``, the MLP's ``c_fc`` / ``c_proj`` (or an ``nn.Sequential`` MLP of
two linear layers, the first colwise, the second rowwise). A fused projection cannot be split by
``parallelize_module``: rank ``r``'s block of its output features would mix query and key
columns, and the attention code splits that output and views it into heads with sizes it reads
from the replicated input or from its attributes. Those models are split by
:mod:`kvgraph.parallel.fused` instead: weights regrouped per rank, the attention's sizes
divided (attributes for GPT-2, whose reshapes use ``-1`` heads; a ``torch.fx`` rewrite of the
attention module's graph otherwise, made before Dynamo captures the model, since the captured
graph must already see one rank's weights) and a functional all-reduce after each rowwise layer.
Other fusions (``qkv_proj``, ``W_pack``, ``query_key_value``, ``Wqkv`` with their own layouts,
``gate_up_proj``) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kvgraph.cache.params import KVCacheParams
from kvgraph.errors import ConfigError, LoweringError

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
REFUSED = ("qkv_proj", "W_pack", "query_key_value", "Wqkv", "gate_up_proj")
FUSED_COLWISE = ("c_fc",)
FUSED_ROWWISE = ("c_proj",)


@dataclass(frozen=True)
class ShardingPlan:
    """Module names (``model.named_modules()``) split colwise and rowwise over ``world_size`` ranks.

    Attributes:
        colwise: linear layers whose output features (weight rows, bias) are split.
        rowwise: linear layers whose input features (weight columns) are split; their outputs
            are all-reduced (the bias is added once).
        world_size: ranks the plan splits over.
        n_heads: query heads of the model (``q_proj.out_features / head_dim``, or a third of
            ``c_attn``'s output features over ``head_dim``).
        n_kv_heads: KV heads of the model.
        fused: attention modules whose ``c_attn`` computes ``[q | k | v]`` (GPT-2, nanoGPT); such
            a plan is applied by :mod:`kvgraph.parallel.fused`, the others by ``parallelize_module``.
    """

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    world_size: int
    n_heads: int
    n_kv_heads: int
    fused: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, world_size: int, params: KVCacheParams) -> ShardingPlan:
        """The plan of ``model`` over ``world_size`` ranks; ``LoweringError`` when the model
        has no splittable projections, fuses them in a way not supported, or a size in a fused
        attention's reshapes does not divide; ``ConfigError`` when heads or MLP width do not divide."""
        from kvgraph.parallel import fused as F

        colwise, rowwise, uneven, attentions = [], [], [], []
        n_heads = None
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in REFUSED:
                raise LoweringError(
                    f"tensor parallelism cannot split {name!r}: it fuses several projections into one "
                    f"output; supported are separate {', '.join(COLWISE[:3])} and {ROWWISE[0]} "
                    f"(the Llama family: Llama, Qwen2, Mistral) or a [q | k | v] {F.FUSED_QKV} with "
                    f"{F.OUT_PROJ} (GPT-2, nanoGPT)"
                )
            if leaf == F.FUSED_QKV:
                attentions.append(name.rpartition(".")[0])
                n_heads = n_heads or F.features(module)[1] // 3 // params.head_dim
                continue
            if leaf == "mlp" and isinstance(module, nn.Sequential):
                layers = [f"{name}.{child}" for child, m in module.named_children() if F.is_projection(m)]
                if len(layers) == 2:
                    colwise.append(layers[0])
                    rowwise.append(layers[1])
                continue
            if leaf not in COLWISE + ROWWISE + FUSED_COLWISE + FUSED_ROWWISE:
                continue
            if not F.is_projection(module):
                raise LoweringError(
                    f"tensor parallelism splits nn.Linear (or GPT-2 Conv1D) layers; {name!r} is a "
                    f"{type(module).__name__}"
                )
            out = leaf in COLWISE + FUSED_COLWISE
            size = F.features(module)[1 if out else 0]
            if size % world_size:
                uneven.append(f"the {size} {'output' if out else 'input'} features of {name!r}")
            (colwise if out else rowwise).append(name)
            if leaf == "q_proj" and n_heads is None:
                n_heads = module.out_features // params.head_dim
        if n_heads is None or not rowwise:
            raise LoweringError(
                f"tensor parallelism found no q_proj/k_proj/v_proj/o_proj or c_attn/c_proj projections in "
                f"{type(model).__name__}: nothing to split over {world_size} ranks"
            )
        plan = cls(tuple(colwise), tuple(rowwise), world_size, n_heads, params.n_kv_heads, tuple(attentions))
        plan.check_heads()
        if uneven:
            raise ConfigError(f"tensor_parallel_size={world_size} does not divide {uneven[0]}")
        for name in attentions:
            F.check_attention(model.get_submodule(name), name, world_size)
        conv = [n for n in colwise + rowwise if not isinstance(model.get_submodule(n), nn.Linear)]
        if conv and not attentions:
            raise LoweringError(
                f"tensor parallelism splits {conv[0]!r} ({type(model.get_submodule(conv[0])).__name__}) only "
                f"in a model with a fused {F.FUSED_QKV}; with separate projections it needs nn.Linear layers"
            )
        return plan

    def check_heads(self) -> None:
        """``ConfigError`` unless query and KV heads split evenly over the ranks."""
        for what, count in (("query heads", self.n_heads), ("KV heads", self.n_kv_heads)):
            if count % self.world_size:
                raise ConfigError(
                    f"tensor_parallel_size={self.world_size} does not divide the model's {count} {what} "
                    f"({self.n_heads} query / {self.n_kv_heads} KV heads): every rank needs whole heads"
                )

    def local_params(self, params: KVCacheParams, device: torch.device) -> KVCacheParams:
        """The cache of one rank: ``n_kv_heads / world_size`` heads of every token, on ``device``."""
        return replace(params, n_kv_heads=params.n_kv_heads // self.world_size, device=device)

    def apply(self, model: nn.Module, mesh: torch.distributed.device_mesh.DeviceMesh) -> nn.Module:
        """Shard ``model`` in place over ``mesh`` (a 1-D mesh of ``world_size`` ranks)."""
        if self.fused:
            from kvgraph.parallel.fused import shard

            shard(model, self.fused, self.colwise, self.rowwise, mesh.get_group())
            return model
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {name: ColwiseParallel() for name in self.colwise}
        styles.update({name: RowwiseParallel() for name in self.rowwise})
        return parallelize_module(model, mesh, styles)
