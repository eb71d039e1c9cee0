import re

import pytest

from kvgraph.cli import main


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    import torch

    torch._dynamo.reset()
    out = tmp_path_factory.mktemp("dump")
    for fmt in ("table", "dot"):
        assert main(["dump", "--model", "gpt2-tiny", "--format", fmt, "-o", str(out / fmt)]) == 0
    return {fmt: (out / fmt).read_text() for fmt in ("table", "dot")}


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
