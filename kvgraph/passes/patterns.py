"""Node patterns of attention as Dynamo captures it: each matcher reads like the eager code.

Dynamo records ``F.scaled_dot_product_attention`` as ``torch._C._nn.scaled_dot_product_attention``,
``q @ k.transpose(-2, -1)`` as ``operator.matmul`` / ``torch.matmul`` on a ``transpose`` call,
and ``nn.Module`` calls as their functional forms. Shape guards (ranks, head counts) use the
nodes' fake values and live here, beside the patterns.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from kvgraph.passes.graph_view import meta_value

Node = torch.fx.Node

SDPA_FUNCTIONS = frozenset({
    F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten.scaled_dot_product_attention,
})
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
# Substrings of targets that compute attention; none may survive lowering.
ATTENTION_TARGET_NAMES = ("scaled_dot_product", "flash_attention", "flex_attention", "efficient_attention")

MATMUL = (frozenset({torch.matmul, operator.matmul, torch.ops.aten.matmul.default}),
          frozenset({"matmul", "__matmul__"}))
SOFTMAX = (frozenset({F.softmax, torch.softmax, torch.special.softmax}), frozenset({"softmax"}))
DROPOUT = (frozenset({F.dropout, torch.dropout}), frozenset())
MUL = (frozenset({operator.mul, torch.mul}), frozenset({"mul", "__mul__", "__rmul__"}))
DIV = (frozenset({operator.truediv, torch.div, torch.true_divide}), frozenset({"div", "__truediv__"}))
ADD = (frozenset({operator.add, torch.add}), frozenset({"add", "__add__", "__radd__"}))
MASKED_FILL = (frozenset({torch.masked_fill}), frozenset({"masked_fill"}))
WHERE = (frozenset({torch.where}), frozenset())
TANH = (frozenset({torch.tanh, F.tanh}), frozenset({"tanh"}))
# Value-preserving conversions allowed around softmax.
CASTS = (frozenset(), frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous"}))
TRANSPOSE = (frozenset({torch.transpose}), frozenset({"transpose"}))
PERMUTE = (frozenset({torch.permute}), frozenset({"permute"}))
REPEAT_INTERLEAVE = (frozenset({torch.repeat_interleave}), frozenset({"repeat_interleave"}))
EXPAND = (frozenset(), frozenset({"expand"}))
UNSQUEEZE = (frozenset({torch.unsqueeze}), frozenset({"unsqueeze"}))
RESHAPE = (frozenset({torch.reshape, torch.flatten}), frozenset({"reshape", "view", "flatten"}))
ARANGE = (frozenset({torch.arange}), frozenset())
LINEAR = (frozenset({F.linear, torch._C._nn.linear}), frozenset())


def is_call(node: Any, kind: tuple[frozenset, frozenset]) -> bool:
    """Whether ``node`` calls one of ``kind = (functions, method names)``."""
    if not isinstance(node, Node):
        return False
    functions, methods = kind
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def static_size(size: Any) -> Any:
    """``size`` as an int when it is one: a SymInt that its ShapeEnv has specialised to a constant
    (a guard such as ``s0 == 5``, met when one input of the graph is dynamic and another static)
    is that constant. Other values are returned as they are."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_number:
        return int(size.node.expr)
    return size


def shape(node: Any) -> tuple | None:
    """The shape of a tensor-valued node (sizes specialised to constants as ints), or None."""
    val = meta_value(node) if isinstance(node, Node) else None
    return tuple(static_size(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Two sizes (ints or SymInts) are the same expression, decided without adding guards."""
    a, b = static_size(a), static_size(b)
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr == b.node.expr
    return a == b


def is_scalar(value: Any) -> bool:
    """A Python number, a symbolic scalar, or a node holding a 0-d tensor or a scalar."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    if not isinstance(value, Node):
        return False
    val = meta_value(value)
    return isinstance(val, (torch.SymFloat, torch.SymInt, int, float)) or (
        isinstance(val, torch.Tensor) and val.dim() == 0
    )


# -- SDPA --
def is_sdpa(node: Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_FUNCTIONS


def sdpa_args(node: Node) -> dict[str, Any]:
    """The arguments of an SDPA call by parameter name, defaults filled in."""
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def is_attention_target(node: Node) -> bool:
    """Any call whose target computes attention (SDPA, flash, flex, ...), by name."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", None) or str(node.target)
    return any(s in name for s in ATTENTION_TARGET_NAMES)


# -- explicit attention --
def is_last_dim_softmax(node: Node) -> bool:
    if not is_call(node, SOFTMAX):
        return False
    dim = arg(node, 1, "dim")
    rank = len(shape(node.args[0]) or ())
    return dim == -1 or (rank > 0 and dim == rank - 1)


def is_token_square(node: object) -> bool:
    """Scores over tokens: a tensor ``[..., T, T]`` whose last two sizes are the same expression."""
    s = shape(node)
    return bool(s) and len(s) >= 2 and same_size(s[-1], s[-2])


def is_identity_dropout(node: Node) -> bool:
    """``F.dropout(x, p, training)`` that is the identity: ``training=False`` or ``p == 0``."""
    if not is_call(node, DROPOUT):
        return False
    p = arg(node, 1, "p", 0.5)
    training = arg(node, 2, "training" if node.target is F.dropout else "train", True)
    return training is False or (isinstance(p, (int, float)) and p == 0)


def strip_transpose_last2(node: Any) -> Node | None:
    """``k`` for ``k.transpose(-2, -1)`` (or ``transpose(2, 3)``, ``permute(0, 1, 3, 2)``) of a 4-D k."""
    if not isinstance(node, Node) or not isinstance(node.args[0], Node):
        return None
    src = node.args[0]
    rank = len(shape(src) or ())
    if rank != 4:
        return None
    if is_call(node, TRANSPOSE):
        dims = {d % rank for d in (arg(node, 1, "dim0"), arg(node, 2, "dim1")) if isinstance(d, int)}
        return src if dims == {2, 3} else None
    if is_call(node, PERMUTE):
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        dims = tuple(dims) if isinstance(dims, (tuple, list)) else ()
        return src if tuple(d % rank for d in dims if isinstance(d, int)) == (0, 1, 3, 2) else None
    return None


def sole_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


# -- repeated K/V (GQA) --
class KVRepeat(enum.Enum):
    """How an attention site's K/V heads were repeated to the query heads."""

    EXPAND_RESHAPE = "expand+reshape"  # Hugging Face's repeat_kv
    REPEAT_INTERLEAVE = "repeat_interleave"
    ENABLE_GQA = "enable_gqa"  # not in the graph: SDPA repeats them itself


@dataclass(frozen=True)
class Unrepeated:
    """A K or V operand with its head repetition undone."""

    node: Node  # the un-repeated tensor [B, Hkv, T, D]
    how: KVRepeat | None  # None: not repeated


def unrepeat_kv(node: Node) -> Unrepeated:
    """The tensor a K/V operand was repeated from (``repeat_kv``), or the operand itself.

    Matches ``x[:, :, None].expand(B, Hkv, n, T, D).reshape(B, Hkv * n, T, D)`` (also with
    ``unsqueeze(2)`` and ``flatten(1, 2)``) and ``x.repeat_interleave(n, dim=1)``, each
    checked on the fake shapes: head ``h`` of the result must be head ``h // n`` of x.
    """
    out = shape(node)
    if out is None or len(out) != 4:
        return Unrepeated(node, None)
    if is_call(node, REPEAT_INTERLEAVE):
        src, dim = node.args[0], arg(node, 2, "dim")
        s = shape(src)
        if isinstance(dim, int) and dim % 4 == 1 and isinstance(arg(node, 1, "repeats"), int) and s and len(s) == 4:
            return Unrepeated(src, KVRepeat.REPEAT_INTERLEAVE)
        return Unrepeated(node, None)
    if is_call(node, RESHAPE) and is_call(node.args[0], EXPAND):
        expanded = node.args[0]
        inserted = expanded.args[0]
        e = shape(expanded)
        if not (isinstance(inserted, Node) and e and len(e) == 5):
            return Unrepeated(node, None)
        src = _unsqueezed_at_2(inserted)
        s = shape(src) if src is not None else None
        if (s and len(s) == 4 and same_size(s[0], e[0]) and same_size(s[1], e[1])
                and same_size(s[2], e[3]) and same_size(s[3], e[4])
                and same_size(out[1], e[1] * e[2])
                and same_size(out[2], s[2]) and same_size(out[3], s[3])):
            return Unrepeated(src, KVRepeat.EXPAND_RESHAPE)
    return Unrepeated(node, None)


def _unsqueezed_at_2(node: Node) -> Node | None:
    """x for ``x[:, :, None]`` / ``x.unsqueeze(2)`` / ``x[:, :, None, :, :]``, else None."""
    if is_call(node, UNSQUEEZE) and arg(node, 1, "dim") in (2, -3):
        return node.args[0]
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        full = slice(None, None, None)
        if isinstance(idx, tuple) and len(idx) >= 3 and idx[0] == full and idx[1] == full and idx[2] is None \
                and all(i == full or i is Ellipsis for i in idx[3:]):
            return src
    return None
