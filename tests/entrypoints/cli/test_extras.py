"""A feature whose extra is not installed fails in one line naming the extra to install."""

import sys

import pytest
import torch

from kvgraph.entrypoints.cli import main
from kvgraph.entrypoints.cli.graph_render import parse_mlir
from kvgraph.entrypoints.cli.graph_svg import svg
from kvgraph.entrypoints.cli.report import plot
from kvgraph.errors import MissingExtraError
from tests.naming import raises_naming


def test_serve_without_fastapi_names_the_serve_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--model", "llama-tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "kvgraph serve: error: kvgraph serve needs the 'serve' extra: pip install 'kvgraph[serve]'"


@pytest.mark.parametrize("feature, missing, extra", [
    (lambda tmp_path: svg({"g": torch.fx.symbolic_trace(torch.nn.Identity())}), "matplotlib", "viz"),
    (lambda tmp_path: plot([], "t", tmp_path / "p.png"), "matplotlib", "viz"),
    (lambda tmp_path: parse_mlir("module {}"), "torch_mlir", "mlir"),
])
def test_a_missing_extra_is_a_typed_error_naming_it(feature, missing, extra, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, missing, None)
    with raises_naming(MissingExtraError, f"'{extra}' extra", f"pip install 'kvgraph[{extra}]'"):

        feature(tmp_path)
