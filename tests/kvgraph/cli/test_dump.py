from kvgraph.cli.graph_render import parse_mlir


def test_dump_mlir_parses_and_types_the_kv_inputs(kvgraph_cli, tmp_path):
    out = tmp_path / "graph.mlir"
    done = kvgraph_cli("dump", "--model", "llama-tiny", "--format", "mlir", "-o", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    module = parse_mlir(text)
    funcs = [op.name.value for op in module.body.operations]
    assert funcs == ["captured", "lowered"]
    lowered = text[text.index("func.func @lowered"):]
    signature = lowered[: lowered.index("{")]
    # llama-tiny: 2 layers, page_size 16, 2 KV heads of 16
    assert "!torch.vtensor<[?,2,2,16,2,16],f32>" in signature
    assert signature.count("!torch.vtensor<[?],si32>") == 2  # cache_lengths, input_row_offsets
    assert "!torch.vtensor<[?,?],si32>" in signature and "!torch.vtensor<[?,2],si32>" in signature
    assert lowered.count('torch.operator "torch.kvgraph.ragged_attention"') == 2
    assert "scaled_dot_product" not in lowered
    assert text.startswith("// kvgraph dump: llama-tiny, stage captured, 2 attention sites")
    assert "// kv_blocks               kv        float32  [total_num_pages, 2, 2, 16, 2, 16]  cpu" in text
