"""SVG drawing of FX graphs for ``kvgraph dump --format svg``: networkx layout, matplotlib output.

No system program is needed (both are kvgraph dependencies). Each stage is one panel, nodes laid
out top to bottom by topological generation: inputs as blue squares, attention sites red, the
output a black diamond, everything else grey; data edges solid, shape-only reads dashed. Text
stays text (``svg.fonttype = none``) so names can be searched in a browser; each panel is the
SVG group ``stage-<name>``.
"""

from __future__ import annotations

import io

import networkx as nx
import torch

from kvgraph.entrypoints.cli.graph_render import is_attention
from kvgraph.errors import require_extra

INCH_PER_LEVEL = 0.28
INCH_PER_COLUMN = 1.1
STYLES = {  # kind: (marker, colour)
    "input": ("s", "#6fa8dc"),
    "attention": ("o", "#e06666"),
    "output": ("D", "#000000"),
    "op": ("o", "#b7b7b7"),
}


def node_kind(node: torch.fx.Node) -> str:
    if is_attention(node):
        return "attention"
    if node.op in ("placeholder", "get_attr"):
        return "input"
    return "output" if node.op == "output" else "op"


def label(node: torch.fx.Node) -> str:
    """The node's name; an attention site's also names its op (``scaled_dot_product_attention``,
    ``ragged_attention.default``)."""
    if not is_attention(node):
        return node.name
    return f"{node.name}: {getattr(node.target, '__name__', node.target)}"


def layout(g: nx.DiGraph) -> dict:
    """Positions ``{node: (x, y)}``: one row per topological generation, top to bottom, centred."""
    pos = {}
    for level, nodes in enumerate(nx.topological_generations(g)):
        for i, node in enumerate(sorted(nodes, key=lambda n: n.name)):
            pos[node] = (i - (len(nodes) - 1) / 2, -level)
    return pos


def svg(graphs: dict[str, torch.fx.GraphModule]) -> str:
    """One SVG document with a panel per graph (``{stage name: graph}``), side by side."""
    require_extra("viz", "kvgraph dump --format svg", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvgraph.passes.graph_view import GraphView

    views = {name: GraphView(gm).g for name, gm in graphs.items()}
    layouts = {name: layout(g) for name, g in views.items()}
    levels = max(1 - min(y for _, y in pos.values()) for pos in layouts.values())
    columns = [1 + max(x for x, _ in pos.values()) * 2 for pos in layouts.values()]
    width = max(4.0, INCH_PER_COLUMN * sum(columns))
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig, axes = plt.subplots(1, len(views), figsize=(width, max(4.0, INCH_PER_LEVEL * levels)), squeeze=False,
                                 width_ratios=columns)
        for ax, (name, g) in zip(axes[0], views.items(), strict=True):
            _draw(ax, name, g, layouts[name])
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg")
        plt.close(fig)
    return out.getvalue()


def _draw(ax, name: str, g: nx.DiGraph, pos: dict) -> None:
    ax.set_gid(f"stage-{name}")
    ax.set_title(f"{name}: {g.number_of_nodes()} nodes, attention sites in red")
    edges = list(g.edges(data=True))
    for dashed in (False, True):
        chosen = [(u, v) for u, v, data in edges if bool(data.get("shape_only")) is dashed]
        nx.draw_networkx_edges(g, pos, edgelist=chosen, ax=ax, width=0.4, arrowsize=4, edge_color="#666666",
                               style="dashed" if dashed else "solid", node_size=30)
    for kind, (marker, colour) in STYLES.items():
        nodes = [n for n in g.nodes if node_kind(n) == kind]
        nx.draw_networkx_nodes(g, pos, nodelist=nodes, ax=ax, node_shape=marker, node_color=colour, node_size=30,
                               label=kind)
    labels = {n: label(n) for n in g.nodes}
    nx.draw_networkx_labels(g, pos, labels, ax=ax, font_size=4, font_family="monospace",
                            verticalalignment="bottom")
    ax.legend(loc="upper right", fontsize=6)
    ax.set_axis_off()
