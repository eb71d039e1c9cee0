"""Prove that an attention site's mask is exactly causal, or causal within a sliding window, by evaluating it.

A site changes its scores before softmax through a list of :class:`MaskEffect`s (an additive
mask, a ``masked_fill``, a boolean SDPA ``attn_mask``). The tensors those effects read are
computed by a *mask subgraph*. Lowering may drop that subgraph only if it is the plain
causal mask, or the causal mask of a sliding window of ``w`` tokens (token ``i`` sees
``j`` for ``i - w < j <= i``: Mistral, Gemma, Qwen2's local layers), which the fused op
applies itself; so :class:`MaskProver`:

1. checks with the networkx view that the subgraph depends only on sizes (the token-count
   SymInt, metadata reads of activations), position ids and constants (module buffers),
   never on activations or other inputs (a padding ``attention_mask``);
2. evaluates it concretely at several token counts (and, when it reads position ids, at two
   position offsets), starting from zero scores, and compares the result with ``tril``:
   every visible score must be left exactly unchanged, every future score pushed below
   ``MASKED`` (``-inf`` or a very negative number); earlier scores may be hidden only as a
   band ``i - j >= w``, the same ``w`` at every size and offset (a window shows from
   ``w + 1`` tokens on; every integer literal ``c`` of the subgraph is checked at ``c + 1``).

Padding masks, ALiBi or other biases, and non-causal masks all fail 2.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import map_aggregate

from kvgraph.errors import LoweringError, WindowNotShownError
from kvgraph.passes.graph_view import GraphView, describe, meta_value, placeholder_kind
from kvgraph.passes.patterns import static_size
from kvgraph.passes.windows import KnownWindows

Node = torch.fx.Node

MASKED = -1.0e4  # a score at or below this is hidden: exp(MASKED - O(10)) == 0 in every float dtype
CHECK_TOKENS = (2, 3, 5, 8)  # token counts every mask is evaluated at (Dynamo specialises 0 and 1)
MAX_CHECK_TOKENS = 8192  # largest token count a mask is evaluated at (Mistral's window is 4096)
POSITION_OFFSETS = (0, 3)
UNBOUNDED = 1 << 30  # integer literals this large (open slices, "no window") bound nothing  # positions arange(T) + offset: causal for a fresh and a continued sequence


@dataclass(frozen=True, kw_only=True)
class MaskProof:
    """What evaluating a mask established: the ``sliding_window`` it applies (keys each token
    sees, itself included; ``None``: plain causal), at ``token_counts`` sizes up to ``max_tokens``."""

    sliding_window: int | None
    token_counts: int
    max_tokens: int

    def __str__(self) -> str:
        window = "" if self.sliding_window is None else f" within a sliding window of {self.sliding_window} tokens"
        return f"mask proven causal{window} at {self.token_counts} token counts up to {self.max_tokens}"


class EffectKind(enum.Enum):
    """How a mask changes the scores ``s``."""

    ADD = "add"  # s + tensor
    FILL = "fill"  # where(tensor, s, value) when keep_where, else s.masked_fill(tensor, value)


@dataclass(frozen=True, kw_only=True)
class MaskEffect:
    """One change a site makes to its scores ``s`` before softmax (see :class:`EffectKind`);
    ``keep_where``: SDPA boolean masks and ``torch.where(cond, s, v)`` keep ``s`` where ``tensor``."""

    kind: EffectKind
    tensor: Node
    value: float | Node | None = None
    keep_where: bool = False

    def nodes(self) -> list[Node]:
        return [n for n in (self.tensor, self.value) if isinstance(n, Node)]


class MaskProver:
    """Evaluates mask subgraphs of one graph; ``prove`` raises ``LoweringError`` unless causal."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        view: GraphView,
        token_count: int | torch.SymInt,
        example_inputs: Sequence[object] | None = None,
        windows: KnownWindows | None = None,
    ) -> None:
        self.gm = gm
        self.windows = windows
        self.view = view
        self.token_count = static_size(token_count)
        self.example_inputs = example_inputs
        self._placeholder_index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
        self._proven: dict[tuple[MaskEffect, ...], MaskProof] = {}
        self._subgraphs: dict[tuple[MaskEffect, ...], frozenset[Node]] = {}

    # -- public --
    def prove(self, site: Node, effects: Sequence[MaskEffect]) -> MaskProof:
        """The window the mask applies and a one-line account, or ``LoweringError`` naming ``site``."""
        key = tuple(effects)
        if key not in self._proven:
            self._proven[key] = self._prove(site, key)
        return self._proven[key]

    def mask_nodes(self, effects: Sequence[MaskEffect]) -> frozenset[Node]:
        """The mask subgraph: every node whose values reach the effects' tensors."""
        key = tuple(effects)
        if key not in self._subgraphs:
            self._subgraphs[key] = frozenset(self.view.data_ancestors(n for e in key for n in e.nodes()))
        return self._subgraphs[key]

    # -- steps --
    def _prove(self, site: Node, effects: tuple[MaskEffect, ...]) -> MaskProof:
        nodes = self.mask_nodes(effects)
        leaves = self.view.leaves(nodes)
        for leaf in leaves:
            self._check_leaf(site, leaf)
        has_positions = any(placeholder_kind(leaf) == "position" for leaf in leaves)
        sizes = self._check_sizes(site, nodes, leaves)
        offsets = POSITION_OFFSETS if has_positions else (0,)
        ordered = sorted(nodes | self.view.shape_sources(set(nodes)), key=self.view.order.__getitem__)
        seen: list[tuple[int, str, int | None]] = []  # (tokens, where, the window shown there or None)
        for T in sizes:
            for offset in offsets:
                where = f"{T} tokens" + (f", positions starting at {offset}" if has_positions else "")
                scores = self._evaluate(site, ordered, nodes, effects, T, offset)
                try:
                    w = _window_of(scores, T)
                except _NotAWindow as e:
                    raise LoweringError(f"cannot lower attention {describe(site)}: its mask {e} (at {where})") from None
                seen.append((T, where, w))
        windows = {w: where for _, where, w in reversed(seen) if w is not None}  # each at its first sighting
        window = min(windows, default=None)
        for T, where, w in seen:
            # one window everywhere: it shows at every size above it, never below
            if window is not None and w != window and (w is not None or T > window):
                other = "no earlier token hidden" if w is None else f"a window of {w} tokens"
                raise LoweringError(
                    f"cannot lower attention {describe(site)}: its mask is a sliding window of {window} tokens at "
                    f"{windows[window]}, but {other} at {where}; only one fixed window can be lowered")
        return MaskProof(sliding_window=window, token_counts=len(sizes), max_tokens=max(sizes))

    def _check_leaf(self, site: Node, leaf: Node) -> None:
        kind = placeholder_kind(leaf)
        if kind == "input":
            raise LoweringError(
                f"cannot lower attention {describe(site)}: its mask depends on graph input '{leaf.name}' "
                "(a padding or custom mask); only causal masks built from sizes, position ids and "
                "constant buffers can be lowered"
            )
        if kind == "size" and not self._is_token_count(meta_value(leaf)):
            raise LoweringError(
                f"cannot lower attention {describe(site)}: its mask depends on the size '{leaf.name}' "
                f"= {meta_value(leaf)}, which is not the token count {self.token_count}"
            )
        if kind == "constant" and self._constant(leaf) is None:
            raise LoweringError(
                f"cannot lower attention {describe(site)}: its mask reads the constant '{leaf.name}' "
                "whose value is not known; pass example_inputs= (the real inputs of the graph) to lower()"
            )

    def _check_sizes(self, site: Node, nodes: set[Node], leaves: list[Node]) -> list[int]:
        """Token counts to evaluate at: the fixed ones, one past every integer literal of the
        subgraph (a window of ``w`` tokens shows at ``w + 1``), and every dimension of the
        constants it reads (a causal buffer is checked whole)."""
        literals = {c for n in nodes if n.op.startswith("call") for c in _int_literals(n)}
        constants = {leaf: self._constant(leaf) for leaf in leaves if placeholder_kind(leaf) == "constant"}
        dims = {d for value in constants.values() for d in value.shape}
        if isinstance(self.token_count, int):
            # A static graph is evaluated at its one token count; what its mask would do beyond
            # it is known only for causal tables (nanoGPT's tril buffer, sliced [:T, :T]).
            # The model's known windows (its config's, or a dynamic graph's) explain their
            # literals: the caller gives its sites those windows.
            T = self.token_count
            tables = sorted(
                max(v.shape) for v in constants.values() if max(v.shape, default=0) > T and not is_causal_table(v))
            known = set() if self.windows is None else set(self.windows.sizes)
            beyond = sorted(c for c in literals if c > T and c not in known) + tables
            if beyond:
                error = WindowNotShownError if not tables and self.windows is None else LoweringError
                raise error(
                    f"cannot lower attention {describe(site)}: the graph was captured for exactly {T} "
                    f"tokens, but its mask uses the size {beyond[0]} (a sliding window?) it cannot be checked "
                    "at; lower a graph of several tokens of the same model first (kvgraph.LLM.warmup() "
                    "does), give the model's windows (the backend's windows option), or capture with "
                    "dynamic=True"
                )
            return [T]
        wanted = set(CHECK_TOKENS) | {c + 1 for c in literals if c >= 2} | {d for d in dims if d >= 2}
        too_big = sorted(s for s in wanted if s > MAX_CHECK_TOKENS)
        if too_big:
            raise LoweringError(
                f"cannot lower attention {describe(site)}: its mask uses the size {too_big[0] - 1} "
                f"(a window or buffer) beyond the {MAX_CHECK_TOKENS} tokens it can be checked at"
            )
        return sorted(wanted)

    def _evaluate(
        self, site: Node, ordered: list[Node], nodes: set[Node], effects: tuple[MaskEffect, ...],
        T: int, offset: int,
    ) -> torch.Tensor:
        """The scores after the effects, starting from zeros: float64 ``[..., T, T]``."""
        env: dict[Node, object] = {}
        try:
            for node in ordered:
                if node not in nodes:
                    env[node] = self._stand_in(site, node, T)
                elif node.op in ("placeholder", "get_attr"):
                    env[node] = self._leaf_value(site, node, T, offset)
                else:
                    env[node] = _run_node(self.gm, node, env)
            scores = torch.zeros((T, T), dtype=torch.float64)
            for e in effects:
                tensor = torch.as_tensor(env[e.tensor]).cpu()
                if e.kind is EffectKind.ADD:
                    scores = scores + tensor.to(torch.float64)
                    continue
                value = float(env[e.value] if isinstance(e.value, Node) else e.value)
                cond = tensor.bool()
                scores = torch.where(cond, scores, value) if e.keep_where else torch.where(cond, value, scores)
        except LoweringError:
            raise
        except Exception as exc:  # any failure to evaluate means "cannot prove": refuse
            raise LoweringError(
                f"cannot lower attention {describe(site)}: its mask could not be evaluated at {T} tokens "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return scores

    # -- values of leaves --
    def _is_token_count(self, size: object) -> bool:
        size = static_size(size)
        if isinstance(self.token_count, int):
            return isinstance(size, int) and size == self.token_count
        return isinstance(size, torch.SymInt) and size.node.expr == self.token_count.node.expr

    def _concrete(self, site: Node, size: object, T: int) -> int:
        size = static_size(size)
        if isinstance(size, int):
            return size
        if isinstance(size, torch.SymInt) and not isinstance(self.token_count, int):
            value = size.node.expr.subs(self.token_count.node.expr, T)
            if value.is_Integer:
                return int(value)
        raise LoweringError(
            f"cannot lower attention {describe(site)}: its mask has the size {size}, "
            f"which is not a function of the token count {self.token_count}"
        )

    def _constant(self, leaf: Node) -> torch.Tensor | None:
        if leaf.op == "get_attr":
            value = self.gm
            for atom in str(leaf.target).split("."):
                value = getattr(value, atom)
            return value
        if self.example_inputs is None:
            return None
        value = self.example_inputs[self._placeholder_index[leaf]]
        return None if isinstance(value, FakeTensor) or not isinstance(value, torch.Tensor) else value

    def _leaf_value(self, site: Node, leaf: Node, T: int, offset: int) -> object:
        kind = placeholder_kind(leaf)
        if kind == "size":
            return T
        if kind == "constant":
            return self._constant(leaf)
        val = meta_value(leaf)  # positions
        dims = [self._concrete(site, d, T) for d in val.shape]
        if not dims or dims[-1] != T:
            raise LoweringError(
                f"cannot lower attention {describe(site)}: position ids '{leaf.name}' have shape "
                f"{tuple(val.shape)}, expected [..., {self.token_count}]"
            )
        positions = torch.arange(offset, offset + T, dtype=val.dtype, device=val.device)
        return positions.reshape([1] * (len(dims) - 1) + [T]).expand(dims).contiguous()

    def _stand_in(self, site: Node, node: Node, T: int) -> object:
        """A tensor of the right shape, dtype and device for a node read only for its metadata."""
        val = meta_value(node)
        if not isinstance(val, torch.Tensor):
            return self._concrete(site, val, T)
        return torch.empty([self._concrete(site, d, T) for d in val.shape], dtype=val.dtype, device=val.device)


def _run_node(gm: torch.fx.GraphModule, node: Node, env: dict[Node, object]) -> object:
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    raise LoweringError(f"unexpected {describe(node)} in a mask subgraph")


def _int_literals(node: Node) -> set[int]:
    found: set[int] = set()

    def visit(a: object) -> object:
        if isinstance(a, int) and not isinstance(a, bool):
            found.add(abs(a))
        elif isinstance(a, slice):
            for part in (a.start, a.stop, a.step):
                visit(part)
        return a

    map_aggregate(node.args, visit)
    map_aggregate(node.kwargs, visit)
    return {c for c in found if c < UNBOUNDED}


def is_causal_table(table: torch.Tensor) -> bool:
    """Whether ``table`` ``[..., N, N]`` is a causal mask over N positions: ``tril`` as bools or
    0/1, or additive (0 on and below the diagonal, ``<= MASKED`` above), in every leading slice."""
    if table.dim() < 2 or table.shape[-1] != table.shape[-2]:
        return False
    n = table.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=table.device).tril()
    z = table.reshape(-1, n, n)
    if z.dtype == torch.bool or bool(((z == 0) | (z == 1)).all()):
        return bool((z.bool() == lower).all())
    z = z.double()
    return bool((z[:, lower] == 0).all() and (z[:, ~lower] <= MASKED).all())


class _NotAWindow(Exception):
    """Why a mask's scores are not causal within one sliding window (what it does instead)."""


def _window_of(scores: torch.Tensor, T: int) -> int | None:
    """The ``w`` for which ``scores`` ([..., T, T], zeros where visible) is the causal mask of a
    sliding window of ``w`` tokens, the same in every leading slice; ``None``: no earlier token
    hidden at this size. ``_NotAWindow`` saying why when it is no such mask."""
    if scores.dim() < 2 or tuple(scores.shape[-2:]) != (T, T) or scores.dim() > 4:
        raise _NotAWindow(f"has shape {tuple(scores.shape)}, not [..., {T}, {T}] (cross-attention or a non-square mask)")
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # i - j
    windows = set()
    for z in scores.reshape(-1, T, T):
        if torch.isnan(z).any():
            raise _NotAWindow("produces NaN scores")
        checks = (
            (lower & (z != 0) & (z > MASKED),
             "adds the bias {b:g} to the score of token {i} for token {j} (ALiBi or another additive bias)"),
            (~lower & (z > MASKED), "lets token {i} see the later token {j} (not causal)"),
        )
        for bad, message in checks:
            if bad.any():
                i, j = (int(x) for x in torch.nonzero(bad)[0])
                raise _NotAWindow(message.format(i=i, j=j, b=float(z[i, j])))
        hidden = lower & (z <= MASKED)
        if not hidden.any():
            windows.add(None)
            continue
        w = int(distance[hidden].min())  # the nearest hidden earlier token: a window of w tokens
        band = lower & (distance >= w)
        if w == 0 or not torch.equal(hidden, band):
            i, j = (int(x) for x in torch.nonzero(hidden if w == 0 else hidden ^ band)[0])
            what = f"hides earlier token {j} from token {i}" if hidden[i, j] else \
                f"shows earlier token {j} to token {i} but hides nearer ones"
            raise _NotAWindow(f"{what}, which no sliding window does (a padding or custom mask)")
        windows.add(w)
    if len(windows) > 1:
        raise _NotAWindow(f"differs between heads or batch rows: windows {sorted(windows, key=str)}")
    return windows.pop()
