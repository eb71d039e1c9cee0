"""kvgraph's folders are its layers: no module imports from a layer above its own, and no module
imports itself through others.

Every ``import`` and ``from ... import`` of every module under ``kvgraph/`` counts, those inside
functions and ``if TYPE_CHECKING:`` blocks included: a deferred import is still a dependency.
``from package import name`` depends on the submodule ``package.name`` when there is one, else on
the package itself.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

import kvgraph
from tests.naming import raises_naming

ROOT = Path(kvgraph.__file__).parent
LAYERS = ("errors", "cache", "ops", "passes", "compiler", "engine", "parallel", "entrypoints")
"""``kvgraph.<first part>`` of each layer, lowest first: a module may import from its own layer and
the ones before it."""
APART = ("__init__", "__main__", "presets", "workloads", "demo")
"""Modules outside the layers: the package's lazy re-exports, ``python -m kvgraph``, and the model
presets, workloads and demo that use the layers (or are used by them); only cycles are checked."""


@dataclass(frozen=True)
class Import:
    """``source`` imports ``target`` at ``line`` (both dotted module names)."""

    source: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> list[Import]:
    """The ``kvgraph`` modules that the code ``source`` of ``module`` imports, wherever it imports them,
    in line order; ``known`` are the package's module names (to tell a submodule from a name)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append(Import(module, node.lineno, submodule if submodule in known else base))
    found = [i for i in dict.fromkeys(found) if i.target == "kvgraph" or i.target.startswith("kvgraph.")]
    return sorted(found, key=lambda i: i.line)


def package_imports(root: Path = ROOT) -> list[Import]:
    """Every import of one ``kvgraph`` module by another in the package under ``root``."""
    names = module_names(root)
    known = set(names)
    return [
        i
        for module, path in names.items()
        for i in imports_of(path.read_text(), module, path.name == "__init__.py", known)
    ]


def layer(module: str) -> int | None:
    """The layer of ``module`` (an index into ``LAYERS``); ``None`` for a module in ``APART``.

    Raises ``KeyError`` for a module that is in neither.
    """
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    if first in APART:
        return None
    if first not in LAYERS:
        raise KeyError(f"{module} is in no layer: put it under one of {LAYERS} or add it to APART")
    return LAYERS.index(first)


def upward(edges: list[Import]) -> list[Import]:
    """The imports that point from a layer to a higher one."""
    return [
        e for e in edges
        if layer(e.source) is not None and layer(e.target) is not None and layer(e.target) > layer(e.source)
    ]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The sets of modules that import each other (directly or through others), one sorted list each."""
    graph = nx.DiGraph((e.source, e.target) for e in edges if e.source != e.target)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def check_layers(edges: list[Import]) -> None:
    """``AssertionError`` listing every import of ``edges`` that points to a higher layer."""
    bad = upward(edges)
    assert not bad, "imports from a higher layer:\n" + "\n".join(
        f"  {e} ({LAYERS[layer(e.source)]} -> {LAYERS[layer(e.target)]})" for e in bad
    )


def check_acyclic(edges: list[Import]) -> None:
    """``AssertionError`` listing every set of modules that import each other, with the imports."""
    found = cycles(edges)
    assert not found, "modules that import each other:\n" + "\n".join(
        "  " + ", ".join(c) + ": " + "; ".join(str(e) for e in edges if e.source in c and e.target in c)
        for c in found
    )


EDGES = package_imports()


def test_every_module_is_in_a_layer_or_apart():
    for module in module_names():
        layer(module)


def test_no_import_points_to_a_higher_layer():
    check_layers(EDGES)


def test_no_import_cycles():
    check_acyclic(EDGES)


def test_the_imports_seen_include_deferred_and_type_checking_ones():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import kvgraph.errors\n"
        "from kvgraph.cache import params, managers\n"
        "if TYPE_CHECKING:\n"
        "    from kvgraph.engine.config import EngineConfig\n"
        "def f():\n"
        "    from kvgraph.compiler.backend import compile\n"
        "    from . import ops\n"
        "    from .passes import log\n"
    )
    known = {"kvgraph.cache.params", "kvgraph.cache.ops", "kvgraph.cache.passes.log"}
    got = imports_of(source, "kvgraph.cache.symbols", False, known)
    assert [(i.line, i.target) for i in got] == [
        (2, "kvgraph.errors"), (3, "kvgraph.cache.params"), (3, "kvgraph.cache"),
        (5, "kvgraph.engine.config"), (7, "kvgraph.compiler.backend"), (8, "kvgraph.cache.ops"),
        (9, "kvgraph.cache.passes.log"),
    ]


def test_a_violating_edge_set_is_reported():
    edges = [
        Import("kvgraph.cache.params", 12, "kvgraph.engine.config"),  # up: cache -> engine
        Import("kvgraph.engine.config", 3, "kvgraph.cache.params"),  # down, and a cycle with the first
        Import("kvgraph.parallel.group", 7, "kvgraph.presets"),  # to a module apart: not a layer violation
        Import("kvgraph.ops.cpp", 4, "kvgraph.ops.checks"),  # same layer
    ]
    assert upward(edges) == [edges[0]]
    assert cycles(edges) == [["kvgraph.cache.params", "kvgraph.engine.config"]]
    with raises_naming(AssertionError, "kvgraph.cache.params:12", "kvgraph.engine.config", "(cache -> engine)"):
        check_layers(edges)
    with raises_naming(AssertionError, "kvgraph.cache.params, kvgraph.engine.config", ":12", ":3"):
        check_acyclic(edges)
    with raises_naming(KeyError, "kvgraph.utils"):

        layer("kvgraph.utils")
