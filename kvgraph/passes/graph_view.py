"""A networkx view of an FX graph, and the dataflow questions the lowering passes ask of it.

``GraphView(gm).g`` is a ``networkx.DiGraph`` over the graph's ``Node`` objects with an
edge ``producer -> user`` for every use. An edge carries ``shape_only=True`` when the
user reads only the producer's metadata (``x.size(1)``, ``x.shape``, ``sym_size``):
such a use does not make the user depend on the producer's *values*, which is what
"this mask depends only on sizes" means. Dataflow helpers walk data edges only.

Placeholders are classified by what they hold (:func:`placeholder_kind`), read from the
source Dynamo records for each graph input (``node._dynamo_source``), never from its name:
``"size"`` (a SymInt), ``"constant"`` (module state: parameters, buffers, attributes; globals
and closure variables), ``"position"`` (the integer ``position_ids`` argument kvgraph calls the
model with) and ``"input"`` (every other argument of the call: token ids, embeddings, attention
masks, encoder states; and any placeholder without a Dynamo source).
"""

from __future__ import annotations

import builtins
import copy
import re
from collections.abc import Iterable

import networkx as nx
import torch
import torch.fx
from torch._dynamo.source import DictGetItemSource, LocalSource
from torch._guards import Source
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import _get_qualified_name

_SHAPE_METHODS = frozenset({"size", "dim", "stride", "numel", "get_device", "ndimension", "nelement"})
_SHAPE_FUNCTIONS = frozenset({
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_size, torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default, torch.numel,
})
_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda"})
POSITION_IDS = "position_ids"  # the keyword kvgraph passes the token positions by


def meta_value(node: torch.fx.Node):
    """The example (usually fake) value of a node: ``meta["val"]`` or Dynamo's ``meta["example_value"]``."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def is_shape_read(user: torch.fx.Node, producer: torch.fx.Node) -> bool:
    """Whether ``user`` reads only the metadata (sizes, dtype, device) of ``producer``."""
    if not user.args or user.args[0] is not producer:
        return False
    if any(a is producer for a in user.args[1:]) or any(v is producer for v in user.kwargs.values()):
        return False
    if user.op == "call_method":
        return user.target in _SHAPE_METHODS
    if user.op == "call_function":
        if user.target is builtins.getattr:
            return len(user.args) > 1 and user.args[1] in _SHAPE_ATTRS
        return user.target in _SHAPE_FUNCTIONS
    return False


def placeholder_kind(node: torch.fx.Node) -> str:
    """``"size"``, ``"constant"``, ``"position"`` or ``"input"`` for a placeholder or get_attr node."""
    if node.op == "get_attr":
        return "constant"
    val = meta_value(node)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return "size"
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return "input"
    guard = source.guard_source
    if guard.is_specialized_nn_module() or guard.is_unspecialized_nn_module() or guard.is_fsdp_module():
        return "constant"
    if not _is_call_argument(source):
        return "constant"
    if isinstance(val, torch.Tensor) and not val.is_floating_point() and _is_position_ids(source):
        return "position"
    return "input"


def _root(source: Source) -> Source:
    while hasattr(source, "base"):
        source = source.base
    return source


def _is_call_argument(source: Source) -> bool:
    """Whether ``source`` reads an argument of the compiled call (not a global or closure variable)."""
    root = _root(source)
    return isinstance(root, LocalSource) and root.is_input


def _is_position_ids(source: Source) -> bool:
    """Whether ``source`` is the call's ``position_ids`` argument, by name or in ``**kwargs``."""
    if isinstance(source, LocalSource):
        return source.local_name == POSITION_IDS
    return (isinstance(source, DictGetItemSource) and source.index == POSITION_IDS
            and isinstance(source.base, LocalSource) and _is_varkw(source.base))


def _is_varkw(source: LocalSource) -> bool:
    """Whether ``source`` is the frame's ``**kwargs``. Dynamo's sources say so in torch 2.13; where
    they do not (torch 2.11), only the name tells (``kwargs``, as Hugging Face models and
    nanoGPT-style modules call it)."""
    flag = getattr(source, "is_varkw", None)
    return source.local_name == "kwargs" if flag is None else flag


def source_location(node: torch.fx.Node) -> str:
    """``file:line: code`` of the user frame that created ``node`` (from ``meta["stack_trace"]``)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', trace)
    if not frames:
        return "unknown source line"
    path, line, code = frames[-1]
    return f"{path}:{line}: {code.strip()}"


def describe(node: torch.fx.Node) -> str:
    """Node name, target and source line, for error messages."""
    if node.op == "call_function":
        target = _get_qualified_name(node.target)
    else:
        target = str(node.target)
    return f"node '{node.name}' ({node.op} {target}) at {source_location(node)}"


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``: same node names, metadata (shallow-copied dicts), Dynamo sources and codegen."""
    copied = torch.fx.Graph(tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    copied._codegen = copy.deepcopy(graph._codegen)
    nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    out, old_output = copied.graph_copy(graph, nodes, return_output_node=True)
    new_output = copied.output(out, type_expr=old_output.type)
    new_output.meta = copy.copy(old_output.meta)
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):  # aot_autograd reads it on the placeholders of Dynamo graphs
            new._dynamo_source = old._dynamo_source
    return copied


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` over a copy of its graph; Dynamo's lazy GraphModules stay lazy (no code generation)."""
    cls = _LazyGraphModule if isinstance(gm, _LazyGraphModule) else torch.fx.GraphModule
    copied = cls(gm, copy_graph(gm.graph))
    copied.meta = dict(gm.meta)
    return copied


class GraphView:
    """A ``networkx.DiGraph`` over the nodes of ``gm.graph`` (edges carry ``shape_only``)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.g = nx.DiGraph()  # every use, edges carry shape_only
        self.data = nx.DiGraph()  # the uses that read values
        self.order: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(gm.graph.nodes):
            self.order[node] = i
            self.g.add_node(node)
            self.data.add_node(node)
            for producer in node.all_input_nodes:
                shape_only = is_shape_read(node, producer)
                self.g.add_edge(producer, node, shape_only=shape_only)
                if not shape_only:
                    self.data.add_edge(producer, node)
        self._sources: dict[torch.fx.Node, frozenset[torch.fx.Node]] | None = None

    def data_ancestors(
        self, nodes: Iterable[torch.fx.Node], cut: frozenset[tuple[torch.fx.Node, torch.fx.Node]] = frozenset()
    ) -> set[torch.fx.Node]:
        """``nodes`` and every node whose values reach one of them.

        Shape-only reads and the ``cut`` edges ``(producer, user)`` stop the walk.
        """
        out: set[torch.fx.Node] = set()
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node not in out:
                out.add(node)
                stack.extend(p for p in self.data.predecessors(node) if (p, node) not in cut)
        return out

    def shape_sources(self, nodes: set[torch.fx.Node]) -> set[torch.fx.Node]:
        """Nodes outside ``nodes`` that ``nodes`` read only through metadata (shape-only edges)."""
        return {u for n in nodes for u in self.g.predecessors(n) if u not in nodes}

    def leaves(self, nodes: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
        """Placeholders and get_attr nodes among ``nodes``, in graph order."""
        return sorted((n for n in nodes if n.op in ("placeholder", "get_attr")), key=self.order.__getitem__)

    def only_feeding(self, candidates: set[torch.fx.Node], consumers: set[torch.fx.Node]) -> set[torch.fx.Node]:
        """The candidates (placeholders excluded) all of whose uses lead only into ``consumers``.

        These are the nodes that die once the consumers are removed: e.g. the mask-building
        subgraph of attention sites that are being lowered.
        """
        dead: set[torch.fx.Node] = set()
        for node in sorted(candidates, key=self.order.__getitem__, reverse=True):
            if node.op == "placeholder":
                continue
            users = set(self.g.successors(node))
            if users and users <= (dead | consumers):
                dead.add(node)
        return dead

    def input_sources(self, node: torch.fx.Node) -> frozenset[torch.fx.Node]:
        """The ``"input"`` placeholders (token ids, masks, encoder states...) whose values reach ``node``."""
        if self._sources is None:
            self._sources = {}
            for n in self.gm.graph.nodes:
                if n.op == "placeholder" and placeholder_kind(n) == "input":
                    self._sources[n] = frozenset((n,))
                    continue
                srcs: frozenset[torch.fx.Node] = frozenset()
                for p in self.data.predecessors(n):
                    srcs |= self._sources[p]
                self._sources[n] = srcs
        return self._sources[node]
