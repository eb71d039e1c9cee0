import re

import pytest

from kvgraph.entrypoints.cli import main


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    import torch

    torch._dynamo.reset()
    out = tmp_path_factory.mktemp("dump")
    for fmt in ("table", "dot", "svg"):
        assert main(["dump", "--model", "gpt2-tiny", "--format", fmt, "-o", str(out / fmt)]) == 0
    return {fmt: (out / fmt).read_text() for fmt in ("table", "dot", "svg")}


def test_table_heads_each_stage_with_its_inputs_and_lists_nodes(dumped):
    text = dumped["table"]
    captured, lowered = text.split("kvgraph dump: gpt2-tiny, stage lowered")
    assert captured.startswith("kvgraph dump: gpt2-tiny, stage captured, 2 attention sites")
    assert "scaled_dot_product_attention" in captured and "ragged_attention" not in captured
    # gpt2-tiny: 2 layers, 4 heads of 16, paged with 16-token pages
    assert re.search(r"kv_blocks\s+kv\s+float32\s+\[total_num_pages, 2, 2, 16, 4, 16\]\s+cpu", lowered)
    assert re.search(r"input_row_offsets\s+kv\s+int32\s+\[batch_size \+ 1\]", lowered)
    assert lowered.count("* attention") == 2 and "scaled_dot_product_attention" not in lowered


def test_dot_highlights_the_attention_sites(dumped):
    text = dumped["dot"]
    assert text.count('digraph "') == 2
    for graph in text.split('digraph "')[1:]:
        highlighted = [line for line in graph.splitlines() if "#e06666" in line]
        assert len(highlighted) == 2
    lowered = text.split('digraph "lowered"')[1]
    assert all("ragged_attention" in line for line in lowered.splitlines() if "#e06666" in line)
    assert text.splitlines()[0].startswith("// kvgraph dump: gpt2-tiny, stage captured")


def test_svg_draws_both_stages_in_one_document_without_graphviz(dumped, monkeypatch):
    import xml.etree.ElementTree as ET

    text = dumped["svg"]
    assert text.index("<!--\nkvgraph dump: gpt2-tiny, stage captured") < text.index("<svg")
    root = ET.fromstring(text[text.index("<svg"):])
    ns = {"svg": "http://www.w3.org/2000/svg"}
    panels = {g.get("id"): " ".join(t.text or "" for t in g.iter("{http://www.w3.org/2000/svg}text"))
              for g in root.iterfind(".//svg:g", ns) if (g.get("id") or "").startswith("stage-")}
    assert set(panels) == {"stage-captured", "stage-lowered"}
    assert "scaled_dot_product_attention" in panels["stage-captured"] and "ragged_attention" not in panels["stage-captured"]
    assert "ragged_attention" in panels["stage-lowered"] and "scaled_dot_product_attention" not in panels["stage-lowered"]
