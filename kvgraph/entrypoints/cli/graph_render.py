"""Text renderings of an FX graph for ``kvgraph dump``: input-symbol table, node table, FX code,
torch-dialect MLIR (torch-mlir) and Graphviz DOT with the attention sites highlighted (SVG drawing:
``kvgraph.entrypoints.cli.graph_svg``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from kvgraph.errors import require_extra

ATTENTION_TARGETS = ("ragged_attention", "scaled_dot_product_attention")
KV_SOURCE_PREFIX = "kv_"  # kvgraph.cache.symbols names the sources of its symbolic dims kv_<name>


def meta_value(node: torch.fx.Node):
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def is_attention(node: torch.fx.Node) -> bool:
    """A lowered ``kvgraph::ragged_attention`` call or a captured SDPA call."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "") or str(node.target)
    return any(t in name or t in str(node.target) for t in ATTENTION_TARGETS)


def dim_text(d: object) -> str:
    """A size as text: an int, or a symbolic expression whose KV symbols carry their kvgraph
    names (``batch_size + 1``); other dynamic dims keep their symbol (``s0``)."""
    if not isinstance(d, torch.SymInt):
        return str(d)
    import sympy

    expr, env = d.node.expr, d.node.shape_env
    names = {}
    for sym in expr.free_symbols:
        for source in env.var_to_sources.get(sym, []) if env is not None else []:
            name = source.name() if callable(source.name) else source.name
            if name.startswith(KV_SOURCE_PREFIX):
                names[sym] = sympy.Symbol(name[len(KV_SOURCE_PREFIX) :], integer=True)
                break
    return str(expr.xreplace(names))


def value_text(value: object) -> tuple[str, str, str]:
    """``(dtype, shape, device)`` of a node's example value (blank for non-tensors)."""
    if isinstance(value, torch.Tensor):
        shape = "[" + ", ".join(dim_text(d) for d in value.shape) + "]"
        return str(value.dtype).removeprefix("torch."), shape, str(value.device)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value_text(value[0])
    if isinstance(value, (torch.SymInt, int)):
        return "int", dim_text(value), ""
    return "", "", ""


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def input_table(gm: torch.fx.GraphModule, kinds: Callable[[torch.fx.Node], str]) -> str:
    """One row per graph input (name, kind, dtype, shape with symbolic dims by name, device);
    module parameters and buffers (kind ``constant``) are summed up in one last line."""
    rows = [["input", "kind", "dtype", "shape", "device"]]
    constants, elements = 0, 0
    for node in gm.graph.find_nodes(op="placeholder"):
        kind, value = kinds(node), meta_value(node)
        if kind == "constant":
            constants += 1
            elements += value.numel() if isinstance(value, torch.Tensor) else 0
            continue
        dtype, shape, device = value_text(value)
        rows.append([node.name, kind, dtype, shape, device])
    table = _columns(rows)
    if constants:
        table += f"\n(+ {constants} constant inputs: module parameters and buffers, {elements:,} elements)"
    return table


def node_table(gm: torch.fx.GraphModule) -> str:
    """One row per node: index, op, name, target, dtype, shape; attention sites marked ``*``."""
    rows = [["#", "op", "name", "target", "dtype", "shape", ""]]
    for i, node in enumerate(gm.graph.nodes):
        dtype, shape, _ = value_text(meta_value(node))
        target = _target_text(node)
        rows.append([str(i), node.op, node.name, target, dtype, shape, "* attention" if is_attention(node) else ""])
    return _columns(rows)


def _target_text(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return ""
    if isinstance(node.target, str):
        return node.target
    module = getattr(node.target, "__module__", None) or ""
    name = getattr(node.target, "__qualname__", None) or getattr(node.target, "__name__", None)
    if name is None:
        return str(node.target)
    return f"{module}.{name}" if module and module not in ("builtins", "_operator") else name


def fx_code(gm: torch.fx.GraphModule) -> str:
    """The graph as readable Python with shape annotations."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def mlir(graphs: dict[str, torch.fx.GraphModule]) -> str:
    """Torch-dialect MLIR of each graph (one ``func.func @<name>`` each, one module) through
    torch-mlir's FX importer.

    Each graph is first traced to ATen ops over its own example (fake) inputs, so dims that
    are symbolic stay ``?`` and the rest static: the KV inputs become typed function
    arguments and ``kvgraph::ragged_attention`` a ``torch.operator``.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    require_extra("mlir", "kvgraph dump --format mlir", "torch_mlir")
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.extras.fx_importer import FxImporter

    context = ir.Context()
    torch_d.register_dialect(context)
    importer = FxImporter(context=context)
    for name, gm in graphs.items():
        examples = [meta_value(n) for n in gm.graph.find_nodes(op="placeholder")]
        with detect_fake_mode(examples):
            aten = make_fx(gm, tracing_mode="real", pre_dispatch=False)(*examples)
        importer.import_stateless_graph(aten.graph, func_name=name)
    return str(importer.module)


def parse_mlir(text: str):
    """Parse torch-dialect MLIR text with torch-mlir's own parser (raises on malformed input)."""
    require_extra("mlir", "kvgraph dump --format mlir", "torch_mlir")
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d

    context = ir.Context()
    torch_d.register_dialect(context)
    context.allow_unregistered_dialects = False
    return ir.Module.parse(text, context)


def dot(gm: torch.fx.GraphModule, name: str) -> str:
    """Graphviz DOT of the networkx view: data edges solid, shape-only reads dashed, inputs as
    boxes, attention sites filled red."""
    from kvgraph.passes.graph_view import GraphView

    view = GraphView(gm)
    ids = {node: f"n{i}" for i, node in enumerate(gm.graph.nodes)}
    lines = [f'digraph "{name}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=9];']
    for node in gm.graph.nodes:
        dtype, shape, _ = value_text(meta_value(node))
        label = "\\n".join(x for x in (node.name, _target_text(node), f"{dtype} {shape}".strip()) if x)
        style = ""
        if is_attention(node):
            style = ', style=filled, fillcolor="#e06666", fontcolor=white'
        elif node.op == "placeholder":
            style = ', shape=box, style=filled, fillcolor="#cfe2f3"'
        elif node.op == "output":
            style = ", shape=doublecircle"
        lines.append(f'  {ids[node]} [label="{_escape(label)}"{style}];')
    for u, v, data in view.g.edges(data=True):
        lines.append(f"  {ids[u]} -> {ids[v]}" + (" [style=dashed];" if data.get("shape_only") else ";"))
    lines.append("}")
    return "\n".join(lines)


def _escape(text: str) -> str:
    return text.replace('"', '\\"')


def comment(text: str, fmt: str) -> str:
    """``text`` as a comment block in the syntax of ``fmt``."""
    if fmt == "svg":
        return "<!--\n" + text.replace("--", "- -") + "\n-->"
    prefix = {"mlir": "// ", "dot": "// ", "fx": "# "}.get(fmt, "")
    return "\n".join((prefix + line).rstrip() for line in text.splitlines())
