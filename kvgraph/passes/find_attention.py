"""Pass 1: locate the attention sites of a Dynamo graph and infer the cache they need.

A site is either

* ``F.scaled_dot_product_attention(q, k, v, ...)`` with ``is_causal=True`` or an
  ``attn_mask`` proven causal (or causal within a sliding window, which the site then carries
  to the fused op), any ``scale``, ``enable_gqa``; or
* the explicit pattern ``matmul(q, k.transpose(-2, -1)) -> (* scale | / scale)* ->
  [/ cap -> tanh -> * cap] -> (+ mask | masked_fill | where)* -> softmax(-1) ->
  (cast | dropout p=0)* -> matmul(., v)``; the bracket is Gemma 2's logit soft-capping, which
  the site carries to the fused op as ``softcap``.

K/V repeated for GQA (``repeat_kv``: expand + reshape, ``repeat_interleave``) are traced back
to the un-repeated tensors, whose head count is the cache's ``n_kv_heads``. Every softmax over
a ``[..., T, T]`` tensor is treated as attention: if it does not match, the graph is refused,
never left half lowered. Token positions must come in as a graph input: an ``arange`` over the
token count reaching q, k or v is refused (a ragged step's tokens are not at 0..T-1). Refusals
raise ``LoweringError`` naming the node, target and source line.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from kvgraph.errors import LoweringError
from kvgraph.passes import patterns as P
from kvgraph.passes.causal_mask import EffectKind, MaskEffect, MaskProof, MaskProver
from kvgraph.passes.graph_view import GraphView, describe, meta_value
from kvgraph.passes.log import log_pass
from kvgraph.passes.patterns import KVRepeat
from kvgraph.passes.windows import KnownWindows, WindowOrigin

Node = torch.fx.Node


class AttentionKind(enum.Enum):
    """The form an attention site was written in."""

    SDPA = "sdpa"  # F.scaled_dot_product_attention
    EXPLICIT = "explicit"  # matmul(q, k^T) -> scales, masks -> softmax -> matmul(., v)


@dataclass(frozen=True)
class CausalFlag:
    """SDPA's ``is_causal=True``: causal by the op's own definition, nothing to prove."""

    def __str__(self) -> str:
        return "is_causal=True"


@dataclass(frozen=True, kw_only=True)
class WindowTaken:
    """A window a fixed-size graph cannot show, taken from the model's known windows."""

    window: int
    origin: WindowOrigin

    def __str__(self) -> str:
        return f"sliding window of {self.window} tokens from {self.origin.value}"


MaskPart = CausalFlag | MaskProof | WindowTaken


@dataclass(kw_only=True)
class AttentionSite:
    """One attention call of the graph, as the lowering needs it.

    ``q`` is ``[1, Hq, T, D]``; ``k``/``v`` are the un-repeated ``[1, Hkv, T, D]``; ``node``
    (the SDPA call or the ``P @ V`` matmul, ``[1, Hq, T, D]``) is what the fused op replaces.
    The op's ``scale`` is ``scale`` times the product of ``scale_factors`` (``("mul" | "div",
    node)`` scalars computed at run time, folded into q).
    """

    node: Node
    kind: AttentionKind
    q: Node
    k: Node
    v: Node
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    scale: float | None
    scale_factors: tuple[tuple[str, Node], ...]
    repeat: KVRepeat | None  # how K/V were repeated (None: not repeated)
    mask: tuple[MaskPart, ...]  # how causality was established
    body: frozenset[Node]  # the nodes of the pattern itself
    layer_idx: int = -1
    sliding_window: int | None = None  # keys each token sees (itself included) under a local mask
    softcap: float | None = None  # scores s become softcap * tanh(s / softcap) before the mask

    @property
    def mask_text(self) -> str:
        """How causality was established, for logs and messages."""
        return "; ".join(map(str, self.mask))

    def __repr__(self) -> str:
        return (f"AttentionSite(layer {self.layer_idx}: {self.kind.value} '{self.node.name}', Hq={self.n_heads}, "
                f"Hkv={self.n_kv_heads}, D={self.head_dim}, {self.dtype}, scale={self.scale}, {self.mask_text})")


@dataclass
class AttentionAnalysis:
    """What pass 1 found: the sites in execution order and the facts the other passes need."""

    sites: list[AttentionSite]
    token_count: int | torch.SymInt  # T of every site (the graph's number of new tokens)
    mask_nodes: frozenset[Node]  # nodes that only build masks: they die with the sites

    @property
    def num_layers(self) -> int:
        return len(self.sites)

    @property
    def n_kv_heads(self) -> int:
        return self.sites[0].n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.sites[0].head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.sites[0].dtype

    @property
    def device(self) -> torch.device:
        return self.sites[0].device


@dataclass(kw_only=True)
class _Match:
    """A matched pattern before the checks that need the whole graph."""

    node: Node
    kind: AttentionKind
    q: Node
    k: Node  # as consumed (maybe repeated)
    v: Node
    scale: float | None
    scale_factors: tuple[tuple[str, Node], ...]
    effects: tuple[MaskEffect, ...]
    is_causal: bool  # SDPA's flag: no mask to prove
    gqa: bool
    body: frozenset[Node]
    softcap: float | None = None


def run(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object] | None = None,
    windows: KnownWindows | None = None,
) -> AttentionAnalysis:
    """Find and check every attention site of ``gm`` (not modified); ``LoweringError`` on refusal.

    ``example_inputs`` (real tensors for ``gm``'s placeholders, as a Dynamo backend receives
    them) let masks that read constant buffers be evaluated. ``windows``: the model's sliding
    windows, known from its config or a graph of the same model with a dynamic token count. A
    graph captured for a fixed token count ``T`` (Dynamo specialises ``T == 1``) cannot show a
    window wider than ``T``, so its sites take these, checked consistent with what ``T`` tokens
    show; a graph of a dynamic token count shows every window, which must equal these.
    """
    start = time.perf_counter()
    view = GraphView(gm)
    matches = [m for node in gm.graph.nodes if (m := _match(node)) is not None]
    if not matches:
        raise LoweringError("no attention site found in the graph: nothing to lower")
    token_count = P.shape(matches[0].q)[2] if len(P.shape(matches[0].q) or ()) == 4 else None
    prover = MaskProver(gm, view, token_count, example_inputs, windows)
    sites = [_check(view, prover, m, token_count) for m in matches]
    for i, site in enumerate(sites):
        site.layer_idx = i
    if windows is not None:
        _take_windows(sites, windows, token_count if isinstance(token_count, int) else None)
    _check_uniform(sites)
    _check_positions_are_inputs(view, sites, matches, token_count)
    mask_nodes = set().union(*(prover.mask_nodes(m.effects) for m in matches))
    dead = view.only_feeding(mask_nodes, set().union(*(s.body for s in sites)))
    analysis = AttentionAnalysis(sites, token_count, frozenset(dead))
    kinds = ", ".join(sorted({s.kind.value + (f"+{s.repeat.value}" if s.repeat else "") for s in sites}))
    log_pass("find_attention", start,
             f"{len(sites)} sites ({kinds}), Hkv={analysis.n_kv_heads}, D={analysis.head_dim}, "
             f"{analysis.dtype}, {len(dead)} mask-only nodes; {sites[0].mask_text}"
             + _windows_text(sites))
    return analysis


# -- matching --
def _one_query_one_key(q: Node, k: Node) -> bool:
    """Whether ``q`` and ``k`` (``[B, H, T, D]``) hold one token each, statically: a graph of one new
    token, where Hugging Face's SDPA path passes ``is_causal=False`` and no mask (OPT, for one)."""
    shapes = (P.shape(q) or (), P.shape(k) or ())
    return all(len(shape) == 4 and isinstance(shape[2], int) and shape[2] == 1 for shape in shapes)


def _match(node: Node) -> _Match | None:
    if P.is_sdpa(node):
        return _match_sdpa(node)
    if P.is_last_dim_softmax(node) and P.is_token_square(node.args[0]):
        return _match_explicit(node)
    if P.is_attention_target(node):
        raise LoweringError(f"cannot lower attention {describe(node)}: unsupported attention op")
    return None


def _match_sdpa(node: Node) -> _Match:
    a = P.sdpa_args(node)
    dropout, is_causal, mask, scale = a["dropout_p"], a["is_causal"], a["attn_mask"], a["scale"]
    if not (isinstance(dropout, (int, float)) and dropout == 0):
        raise LoweringError(f"cannot lower attention {describe(node)}: dropout_p={dropout!r} is not 0")
    if not isinstance(is_causal, bool):
        raise LoweringError(f"cannot lower attention {describe(node)}: is_causal={is_causal!r} is not a constant")
    if mask is None and not is_causal:
        if not _one_query_one_key(a["query"], a["key"]):
            raise LoweringError(
                f"cannot lower attention {describe(node)}: is_causal=False without an attn_mask is "
                "bidirectional (not causal) attention"
            )
        is_causal = True  # one new token over itself (a graph of T == 1): bidirectional is causal
    if mask is not None and is_causal:
        raise LoweringError(f"cannot lower attention {describe(node)}: both attn_mask and is_causal=True")
    if isinstance(mask, Node):
        dtype = getattr(meta_value(mask), "dtype", None)
        effects = ((MaskEffect(kind=EffectKind.FILL, tensor=mask, value=float("-inf"), keep_where=True),)
                   if dtype == torch.bool else (MaskEffect(kind=EffectKind.ADD, tensor=mask),))
    elif mask is None:
        effects = ()
    else:
        raise LoweringError(f"cannot lower attention {describe(node)}: attn_mask={mask!r} is not a tensor")
    factors: tuple[tuple[str, Node], ...] = ()
    if isinstance(scale, Node):
        if not P.is_scalar(scale):
            raise LoweringError(f"cannot lower attention {describe(node)}: scale '{scale.name}' is not a scalar")
        factors, scale = (("mul", scale),), 1.0
    elif scale is not None:
        scale = float(scale)
    return _Match(node=node, kind=AttentionKind.SDPA, q=a["query"], k=a["key"], v=a["value"], scale=scale,
                  scale_factors=factors, effects=effects, is_causal=is_causal, gqa=bool(a["enable_gqa"]),
                  body=frozenset((node,)))


def _match_explicit(softmax: Node) -> _Match:
    steps = _score_chain(softmax.args[0])
    if steps is None:
        raise LoweringError(
            f"cannot lower attention {describe(softmax)}: softmax over [..., T, T] scores that do not "
            "come from matmul(q, k.transpose(-2, -1)) through scales and masks"
        )
    qk, chain = steps
    for node in (qk, *(n for n, _ in chain)):
        if len(node.users) != 1:
            names = ", ".join(u.name for u in node.users)
            raise LoweringError(
                f"cannot lower attention {describe(softmax)}: the attention scores '{node.name}' are also used "
                f"by {names}"
            )
    q, k = qk.args[0], P.strip_transpose_last2(qk.args[1])
    chain, softcap = _soft_cap(softmax, chain)
    scale, factors, effects = 1.0, [], []
    for node, pos in chain:
        side = [a for i, a in enumerate(node.args) if i != pos]
        if P.is_call(node, P.CASTS):
            continue
        if P.is_call(node, P.MUL) and len(side) == 1 and P.is_scalar(side[0]):
            scale, factors = _apply_factor("mul", side[0], scale, factors)
        elif P.is_call(node, P.DIV) and pos == 0 and len(side) == 1 and P.is_scalar(side[0]):
            scale, factors = _apply_factor("div", side[0], scale, factors)
        elif P.is_call(node, P.ADD) and len(side) == 1 and isinstance(side[0], Node) and not P.is_scalar(side[0]):
            effects.append(MaskEffect(kind=EffectKind.ADD, tensor=side[0]))
        elif P.is_call(node, P.MASKED_FILL) and pos == 0:
            effects.append(MaskEffect(kind=EffectKind.FILL, tensor=P.arg(node, 1, "mask"), value=P.arg(node, 2, "value")))
        elif P.is_call(node, P.WHERE) and pos in (1, 2) and len(node.args) == 3:
            cond, value = node.args[0], node.args[3 - pos]
            effects.append(MaskEffect(kind=EffectKind.FILL, tensor=cond, value=value, keep_where=(pos == 1)))
        else:
            raise LoweringError(f"cannot lower attention {describe(node)}: unsupported op on the attention scores")
    pv, tail = _weights_to_pv(softmax)
    if not effects:
        raise LoweringError(
            f"cannot lower attention {describe(softmax)}: no mask between the scores and softmax "
            "(bidirectional attention is not causal)"
        )
    body = frozenset({qk, qk.args[1], softmax, pv, *tail, *(n for n, _ in steps[1])})  # with a soft-cap's nodes
    return _Match(node=pv, kind=AttentionKind.EXPLICIT, q=q, k=k, v=pv.args[1], scale=scale,
                  scale_factors=tuple(factors), effects=tuple(effects), is_causal=False, gqa=False, body=body,
                  softcap=softcap)


def _soft_cap(softmax: Node, chain: list[tuple[Node, int]]) -> tuple[list[tuple[Node, int]], float | None]:
    """The chain without a ``/ c -> tanh -> * c`` soft-cap, and ``c`` (``None`` without one).

    The cap must come after every scale factor and before every mask: a scale after it is not
    a softmax scale, and a mask before it would be squashed to ``-c`` instead of hiding a key.
    """
    ops = [(n, pos) for n, pos in chain if not P.is_call(n, P.CASTS)]
    at = [i for i, (n, _) in enumerate(ops) if P.is_call(n, P.TANH)]
    if not at:
        return chain, None

    def refuse(why: str) -> LoweringError:
        return LoweringError(f"cannot lower attention {describe(softmax)}: {why}")

    i = at[0]
    if len(at) > 1 or i == 0 or i + 1 >= len(ops):
        raise refuse("tanh on the attention scores is not one soft-cap '/ c -> tanh -> * c'")
    (div, div_pos), (mul, _) = ops[i - 1], ops[i + 1]
    cap_in = div.args[1] if P.is_call(div, P.DIV) and div_pos == 0 and len(div.args) == 2 else None
    cap_out = next((a for a in mul.args if a is not ops[i][0]), None) if P.is_call(mul, P.MUL) else None
    c_in, c_out = _scalar_value(cap_in), _scalar_value(cap_out)
    if c_in is None or c_in != c_out or not c_in > 0:
        raise refuse(f"tanh on the attention scores between '{div.name}' and '{mul.name}' is not a soft-cap "
                     "'/ c -> tanh -> * c' by one positive constant c")
    if any(not (P.is_call(n, P.MUL) or P.is_call(n, P.DIV)) for n, _ in ops[:i - 1]):
        raise refuse(f"a mask is applied before the soft-cap '{ops[i][0].name}'; it would be squashed, not hidden")
    if any(P.is_call(n, P.MUL) or P.is_call(n, P.DIV) for n, _ in ops[i + 2:]):
        raise refuse(f"the scores are scaled after the soft-cap '{ops[i][0].name}'")
    capped = {div, ops[i][0], mul}
    return [(n, pos) for n, pos in chain if n not in capped], c_in


def _scalar_value(value: object) -> float | None:
    """A constant scalar's value: a number, or a node holding one (Dynamo reads float module
    attributes with ``.item()``: a symbolic float whose value the trace recorded)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, Node):
        return None
    val = meta_value(value)
    if isinstance(val, torch.SymFloat):
        hint = val.node.hint
        return None if hint is None else float(hint)
    if isinstance(val, (int, float)) and not isinstance(val, bool):
        return float(val)
    return None


def _score_chain(node: object) -> tuple[Node, list[tuple[Node, int]]] | None:
    """``(qk_matmul, [(op, index of the scores operand), ...] from the matmul to softmax)``."""
    if not isinstance(node, Node):
        return None
    if P.is_call(node, P.MATMUL) and P.strip_transpose_last2(node.args[1]) is not None:
        return node, []
    if not any(P.is_call(node, kind) for kind in (P.CASTS, P.MUL, P.DIV, P.ADD, P.MASKED_FILL, P.WHERE, P.TANH)):
        return None
    for pos, operand in enumerate(node.args):
        found = _score_chain(operand)
        if found is not None:
            qk, chain = found
            return qk, [*chain, (node, pos)]
    return None


def _apply_factor(op: str, value: object, scale: float, factors: list) -> tuple[float, list]:
    if isinstance(value, Node):
        return scale, [*factors, (op, value)]
    return (scale * value if op == "mul" else scale / value), factors


def _weights_to_pv(softmax: Node) -> tuple[Node, list[Node]]:
    """The ``P @ V`` matmul that consumes the softmax (through casts and p=0 dropout), and the nodes between."""
    node, tail = softmax, []
    while True:
        user = P.sole_user(node)
        if user is None:
            names = ", ".join(u.name for u in node.users) or "nothing"
            raise LoweringError(
                f"cannot lower attention {describe(softmax)}: the attention weights '{node.name}' are used by "
                f"{names}, not only by P @ V"
            )
        if P.is_call(user, P.MATMUL) and user.args[0] is node:
            return user, tail
        if not (P.is_call(user, P.CASTS) or P.is_identity_dropout(user)):
            raise LoweringError(
                f"cannot lower attention {describe(softmax)}: the attention weights feed {describe(user)}, "
                "not P @ V"
            )
        node = user
        tail.append(node)


# -- checks --
def _check(view: GraphView, prover: MaskProver, m: _Match, token_count: object) -> AttentionSite:
    """Shapes, GQA, cross-attention and causality of one match."""
    def refuse(why: str) -> LoweringError:
        return LoweringError(f"cannot lower attention {describe(m.node)}: {why}")

    qs, ks, vs = P.shape(m.q), P.shape(m.k), P.shape(m.v)
    if not (qs and ks and vs and len(qs) == len(ks) == len(vs) == 4):
        raise refuse(f"q, k, v must be [batch, heads, tokens, head_dim], got {qs}, {ks}, {vs}")
    if qs[0] != 1 or ks[0] != 1 or vs[0] != 1:
        raise refuse(f"the graph attends over a batch of {qs[0]}; lower graphs written for one sequence [1, T]")
    if not P.same_size(qs[2], token_count):
        raise refuse(f"q has {qs[2]} tokens but the graph's other sites have {token_count}")
    if not (P.same_size(ks[2], qs[2]) and P.same_size(vs[2], qs[2])):
        raise refuse(f"K/V have {ks[2]} positions but Q has {qs[2]} (cross-attention or a KV cache in the graph)")
    q_src, k_src, v_src = (view.input_sources(n) for n in (m.q, m.k, m.v))
    if k_src != q_src or v_src != q_src:
        other = sorted(n.name for n in (k_src | v_src) ^ q_src)
        raise refuse(f"K/V and Q come from different graph inputs ({', '.join(other)}): cross-attention")
    k, v, how = _unrepeat(m)
    ks, vs = P.shape(k), P.shape(v)
    Hq, D, Hkv = qs[1], qs[3], ks[1]
    if not all(isinstance(x, int) for x in (Hq, D, Hkv, vs[1], vs[3])):
        raise refuse(f"head counts and head_dim must be static, got q {qs}, k {ks}, v {vs}")
    if vs[1] != Hkv or vs[3] != D or ks[3] != D:
        raise refuse(f"k {ks} and v {vs} must both be [1, Hkv, T, {D}]")
    if Hq % Hkv != 0 or (Hkv != Hq and how is None):
        raise refuse(f"{Hq} query heads cannot share {Hkv} kv heads")
    dtypes = {meta_value(n).dtype for n in (m.q, k, v)}
    if len(dtypes) != 1:
        raise refuse(f"q, k, v dtypes differ: {sorted(map(str, dtypes))}")
    proof = None if m.is_causal else prover.prove(m.node, m.effects)
    val = meta_value(m.q)
    return AttentionSite(
        node=m.node, kind=m.kind, q=m.q, k=k, v=v, n_heads=Hq, n_kv_heads=Hkv, head_dim=D, dtype=val.dtype,
        device=val.device, scale=m.scale, scale_factors=m.scale_factors, repeat=how,
        mask=(CausalFlag(),) if proof is None else (proof,), body=m.body,
        sliding_window=None if proof is None else proof.sliding_window, softcap=m.softcap,
    )


def _unrepeat(m: _Match) -> tuple[Node, Node, KVRepeat | None]:
    """The un-repeated K and V of a match (both or neither), and how they were repeated."""
    if m.gqa:
        return m.k, m.v, KVRepeat.ENABLE_GQA
    k, v = P.unrepeat_kv(m.k), P.unrepeat_kv(m.v)
    if k.how is None or v.how is None or P.shape(k.node)[1] != P.shape(v.node)[1]:
        return m.k, m.v, None
    return k.node, v.node, k.how


def _check_positions_are_inputs(
    view: GraphView, sites: list[AttentionSite], matches: list[_Match], token_count: object
) -> None:
    """Refuse token positions computed inside the graph (``arange(T)`` reaching q, k or v).

    After lowering, the ``T`` tokens of a step belong to several sequences and continue their
    caches, so ``0..T-1`` are not their positions: positions must come in as an input. Masks
    are cut off the walk (their aranges only reach later layers through attention).
    """
    masks = frozenset((e, n) for m in matches for e in (x for f in m.effects for x in f.nodes()) for n in m.body)
    values = view.data_ancestors((n for s in sites for n in (s.q, s.k, s.v)), cut=masks)
    for node in sorted(values, key=view.order.__getitem__):
        s = P.shape(node) if P.is_call(node, P.ARANGE) else None
        if s and len(s) == 1 and P.same_size(s[0], token_count):
            raise LoweringError(
                f"cannot lower attention {describe(sites[0].node)}: token positions come from "
                f"{describe(node)}, computed from the token count; in a ragged batch they are not "
                "0..T-1, so pass position ids as a graph input (HF: position_ids=)"
            )


def _take_windows(sites: list[AttentionSite], windows: KnownWindows, T: int | None) -> None:
    """Check the sites' windows against the model's known ones; a fixed-size graph of ``T`` tokens
    takes those it cannot show (wider than ``T``), a graph of a dynamic count (``T=None``) none."""
    if len(windows.sizes) != len(sites):
        raise LoweringError(
            f"the graph has {len(sites)} attention sites, but {windows.origin.value} gives "
            f"{len(windows.sizes)} sliding windows; one model must capture the same layers at every token count")
    for site, known in zip(sites, windows.sizes, strict=True):
        shown = site.sliding_window
        if shown != known and (T is None or shown is not None or known is None or T > known):
            at = "at every token count" if T is None else f"at {T} tokens"
            raise LoweringError(
                f"cannot lower attention {describe(site.node)}: {at} its mask is "
                f"{'plain causal' if shown is None else f'a sliding window of {shown} tokens'}, but in "
                f"{windows.origin.value} {'plain causal' if known is None else f'a window of {known}'}")
        if known is not None and shown is None:
            site.sliding_window = known
            site.mask = (*site.mask, WindowTaken(window=known, origin=windows.origin))


def _windows_text(sites: list[AttentionSite]) -> str:
    windowed = [s for s in sites if s.sliding_window is not None]
    if not windowed:
        return ""
    sizes = sorted({s.sliding_window for s in windowed})
    return f"; {len(windowed)} of {len(sites)} sites in sliding windows of {', '.join(map(str, sizes))} tokens"


def _check_uniform(sites: list[AttentionSite]) -> None:
    """One cache layout serves every layer: all sites share Hkv, head_dim, dtype and device."""
    first = sites[0]
    for s in sites[1:]:
        for name in ("n_kv_heads", "head_dim", "dtype", "device"):
            if getattr(s, name) != getattr(first, name):
                raise LoweringError(
                    f"cannot lower attention {describe(s.node)}: {name}={getattr(s, name)} differs from "
                    f"{name}={getattr(first, name)} of layer 0 ({first.node.name}); one cache needs one layout"
                )
