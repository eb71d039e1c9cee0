"""Tensor parallelism for models that fuse Q, K and V into one projection: GPT-2's and nanoGPT's ``c_attn``.

A colwise split of the fused weight would give rank ``r`` output features ``[r * 3C/N, (r+1) * 3C/N)``,
a mix of query and key columns, and the attention code around it splits that output at ``C``,
views each part with ``H`` heads and views its result back to ``C`` features, sizes it reads from
the replicated input (``B, T, C = x.size()``) or from its own attributes. So each rank gets three
things done to it:

1. **weights** (plain tensors, this rank's shard only): the fused projection's output features
   regrouped so that rank ``r`` holds ``[its q heads | its k heads | its v heads]`` (weight rows of
   ``nn.Linear``, weight columns of GPT-2's ``Conv1D``, and the bias); the MLP's first layer split
   by output features; the output projection and the MLP's second layer split by input features,
   their bias kept on rank 0 alone (zero elsewhere) so that it is added once.
2. **sizes**: an attention module of Hugging Face GPT-2 reshapes with ``-1`` heads and splits at
   ``self.split_size``: ``split_size`` and ``num_heads`` are divided by ``N``. Any other attention
   module (nanoGPT's) is traced with ``torch.fx`` and its graph rewritten by
   :func:`per_rank_attention`, then put in its place.
3. **communication**: a forward hook on every input-split layer all-reduces its output with
   ``torch.distributed._functional_collectives.all_reduce``, which Dynamo traces into the captured
   graph (``_c10d_functional.all_reduce`` then ``wait_tensor``): two per layer, as in the Llama plan.

``parallelize_module`` is not used here: its styles take ``nn.Linear`` only (GPT-2's ``Conv1D``
stores its weight transposed, ``[in, out]``), and what it returns for a colwise layer is a
contiguous block of output features, not the three regrouped blocks a fused projection needs.
"""

from __future__ import annotations

import functools
import operator
import time

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from kvgraph.errors import LoweringError
from kvgraph.passes.log import log_pass

FUSED_QKV = "c_attn"
"""The fused ``[q | k | v]`` projection of GPT-2 and nanoGPT (output ``3C``)."""
OUT_PROJ = "c_proj"
"""Its attention module's output projection (input ``C``)."""
RESHAPES = ("view", "reshape")


def conv1d_type() -> type | None:
    """``transformers.pytorch_utils.Conv1D`` (a linear layer with its weight stored ``[in, out]``), if installed."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def is_gpt2_attention(module: nn.Module) -> bool:
    """Hugging Face ``GPT2Attention``: reshapes with ``-1`` heads, splits at ``self.split_size``."""
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    except ImportError:
        return False
    return isinstance(module, GPT2Attention)


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a GPT-2 ``Conv1D``: the layers the fused plan splits."""
    conv1d = conv1d_type()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def check_attention(attn: nn.Module, name: str, world_size: int) -> None:
    """``LoweringError`` unless ``attn`` (holding ``c_attn`` and ``c_proj``) can be split over
    ``world_size`` ranks: a ``[q | k | v]`` projection of three equal parts, and an attention
    module that is GPT-2's or whose graph :func:`per_rank_attention` can rewrite."""
    fused, out = getattr(attn, FUSED_QKV), getattr(attn, OUT_PROJ, None)
    if out is None or not is_projection(out) or not is_projection(fused):
        raise LoweringError(
            f"tensor parallelism cannot split {name!r}: it needs {FUSED_QKV} and {OUT_PROJ} as nn.Linear or "
            f"Conv1D layers"
        )
    hidden = features(out)[0]
    if features(fused)[1] != 3 * hidden:
        raise LoweringError(
            f"tensor parallelism cannot split '{name}.{FUSED_QKV}': its {features(fused)[1]} output features "
            f"are not [q | k | v] of {hidden} each (cross-attention or grouped KV heads)"
        )
    if not is_gpt2_attention(attn):
        per_rank_attention(attn, name, world_size)


def per_rank_attention(attn: nn.Module, name: str, world_size: int) -> torch.fx.GraphModule:
    """``attn`` traced with ``torch.fx`` and rewritten to run one rank's ``1/world_size`` of its heads.

    The pattern, as nanoGPT writes it::

        q, k, v = self.c_attn(x).split(C, dim=2)          # split sizes     C -> C/N
        q = q.view(B, T, self.n_head, C // self.n_head)   # heads (dim -2)  H -> H/N, per chunk
        ...
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # last size       C -> C/N
        return self.c_proj(y)

    A ``-1`` size is left as it is. ``LoweringError`` naming the node when the module does
    not trace or does not match (the sizes of a site that is not rewritten would be wrong).
    """
    start = time.perf_counter()
    tracer = torch.fx.Tracer()
    tracer.proxy_buffer_attributes = True  # nanoGPT slices its mask buffer with the traced T
    try:
        graph = tracer.trace(attn)
    except Exception as e:
        raise LoweringError(
            f"tensor parallelism cannot split {name!r}: torch.fx cannot trace {type(attn).__name__}.forward "
            f"({type(e).__name__}: {e})"
        ) from None
    gm = torch.fx.GraphModule(attn, graph, class_name=type(attn).__name__)
    refuse = functools.partial(_refuse, name)
    fused = _only_call(gm, FUSED_QKV, refuse)
    out = _only_call(gm, OUT_PROJ, refuse)
    (split,) = fused.users if len(fused.users) == 1 else (None,)
    if split is None or split.target not in ("split", torch.split):
        refuse(fused, "its output is not split once into q, k and v")
    _divide_arg(split, 1, world_size, refuse)
    views = 0
    for chunk in list(split.users):
        for view in list(chunk.users):
            sizes = _sizes(view, refuse)
            if len(sizes) != 4:
                refuse(view, f"a part of the fused output is viewed as {len(sizes)} dims, not [B, T, heads, head_dim]")
            _divide_size(view, 2, world_size, refuse)
            views += 1
    if views != 3:
        refuse(split, f"{views} views of its parts into heads, not 3 (q, k, v)")
    (merge,) = out.args
    _divide_size(merge, len(_sizes(merge, refuse)) - 1, world_size, refuse)
    gm.recompile()
    log_pass("fused_qkv", start, f"{name}: split, 3 head views and the output view divided by {world_size}")
    return gm


def shard(model: nn.Module, attentions: tuple[str, ...], colwise: tuple[str, ...], rowwise: tuple[str, ...],
          group: dist.ProcessGroup) -> None:
    """Split ``model`` in place as this rank of ``group``: each attention module in ``attentions``
    gets this rank's heads (its ``c_attn`` regrouped, its sizes divided), the ``colwise`` layers
    keep their share of output features, the ``rowwise`` ones their share of input features and
    an all-reduce of their output."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for name in attentions:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, shard_attention(model.get_submodule(name), name, rank, n))
    for name in colwise:
        split_out(model.get_submodule(name), rank, n, parts=1)
    for name in rowwise:
        split_in(model.get_submodule(name), rank, n)
        model.get_submodule(name).register_forward_hook(functools.partial(_all_reduce, group))


def shard_attention(attn: nn.Module, name: str, rank: int, n: int) -> nn.Module:
    """``attn`` as rank ``rank`` of ``n`` runs it: its ``c_attn`` keeps this rank's q, k and v heads
    and its sizes are divided (GPT-2's attributes, or the rewritten graph that replaces it). Its
    ``c_proj`` is left to the rowwise split."""
    split_out(getattr(attn, FUSED_QKV), rank, n, parts=3)
    if is_gpt2_attention(attn):
        attn.split_size //= n
        attn.num_heads //= n
        return attn
    return per_rank_attention(attn, name, n)


def _all_reduce(group: dist.ProcessGroup, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of an input-split layer's partial outputs."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(output, "sum", group)


def _take(t: torch.Tensor, dim: int, rank: int, n: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s ``1/n`` of each of ``t``'s ``parts`` equal blocks along ``dim``, concatenated."""
    return torch.cat([block.chunk(n, dim)[rank] for block in t.chunk(parts, dim)], dim).contiguous()


def _out_dim(module: nn.Module) -> int:
    """The weight's output-features dim: 0 for ``nn.Linear`` (``[out, in]``), 1 for ``Conv1D`` (``[in, out]``)."""
    return 0 if isinstance(module, nn.Linear) else 1


def _set(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    setattr(module, attr, nn.Parameter(value, requires_grad=getattr(module, attr).requires_grad))


def split_out(module: nn.Module, rank: int, n: int, parts: int) -> None:
    """Keep this rank's output features of each of ``parts`` blocks (weight and bias)."""
    _set(module, "weight", _take(module.weight.detach(), _out_dim(module), rank, n, parts))
    if module.bias is not None:
        _set(module, "bias", _take(module.bias.detach(), 0, rank, n, parts))
    if isinstance(module, nn.Linear):
        module.out_features //= n
    else:
        module.nf //= n  # Conv1D views its output to ``nf`` features


def split_in(module: nn.Module, rank: int, n: int) -> None:
    """Keep this rank's input features; the bias stays on rank 0 alone (added once by the all-reduce)."""
    _set(module, "weight", _take(module.weight.detach(), 1 - _out_dim(module), rank, n, 1))
    if module.bias is not None and rank != 0:
        _set(module, "bias", torch.zeros_like(module.bias))
    if isinstance(module, nn.Linear):
        module.in_features //= n


def _refuse(name: str, node: torch.fx.Node | None, why: str) -> None:
    where = "" if node is None else f"node {node.name} ({node.op} {getattr(node.target, '__name__', node.target)}): "
    raise LoweringError(f"tensor parallelism cannot split {name!r}: {where}{why}")


def _only_call(gm: torch.fx.GraphModule, target: str, refuse) -> torch.fx.Node:
    """The one call of submodule ``target``."""
    calls = gm.graph.find_nodes(op="call_module", target=target)
    if len(calls) != 1:
        refuse(None, f"{target} is called {len(calls)} times, not once")
    return calls[0]


def _sizes(node: torch.fx.Node, refuse) -> list:
    """The sizes of a ``view``/``reshape`` node, given as varargs or as one tuple."""
    if node.op != "call_method" or node.target not in RESHAPES:
        refuse(node, f"expected a {' or '.join(RESHAPES)} here, whose sizes can be divided")
    sizes = node.args[1:]
    return list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else list(sizes)


def _divide_size(view: torch.fx.Node, index: int, n: int, refuse) -> None:
    """Divide size ``index`` of a ``view``/``reshape`` node by ``n`` (a ``-1`` stays)."""
    sizes = _sizes(view, refuse)
    sizes[index] = _divided(view, sizes[index], n, refuse)
    view.args = (view.args[0], *sizes)


def _divide_arg(node: torch.fx.Node, index: int, n: int, refuse) -> None:
    """Divide positional argument ``index`` of ``node`` (an int, a node, or a list of them) by ``n``."""
    if len(node.args) <= index:
        refuse(node, "its split size is not a positional argument")
    value = node.args[index]
    if isinstance(value, (tuple, list)):
        value = type(value)(_divided(node, v, n, refuse) for v in value)
    else:
        value = _divided(node, value, n, refuse)
    node.args = (*node.args[:index], value, *node.args[index + 1:])


def _divided(user: torch.fx.Node, size: object, n: int, refuse) -> object:
    """``size // n``: folded for an int, a new ``floordiv`` node before ``user`` for a traced size."""
    if isinstance(size, torch.fx.Node):
        with user.graph.inserting_before(user):
            return user.graph.call_function(operator.floordiv, (size, n))
    if not isinstance(size, int):
        refuse(user, f"size {size!r} is neither an int nor a traced size")
    if size == -1:
        return size
    if size % n:
        refuse(user, f"tensor_parallel_size={n} does not divide its size {size}")
    return size // n
