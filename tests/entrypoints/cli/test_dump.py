from kvgraph.entrypoints.cli.graph_render import parse_mlir


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
    assert signature.count("!torch.vtensor<[?],si32>") == 3  # cache_lengths, input_row_offsets, logit_positions
    assert "!torch.vtensor<[?,?],si32>" in signature and "!torch.vtensor<[?,2],si32>" in signature
    assert lowered.count('torch.operator "torch.kvgraph.ragged_attention"') == 2
    assert "scaled_dot_product" not in lowered
    assert text.startswith("// kvgraph dump: llama-tiny, stage captured, 2 attention sites")
    assert "// kv_blocks               kv        float32  [total_num_pages, 2, 2, 16, 2, 16]  cpu" in text


def test_mlir_of_a_windowed_soft_capped_model_carries_both_per_layer():
    """Gemma 2: layer 0 local (window 4), layer 1 global; both soft-capped at 50."""
    import torch
    import transformers

    from kvgraph.entrypoints.cli.graph_render import mlir
    from kvgraph.passes import lower

    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, attn_implementation="eager")).eval()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ids, positions = torch.tensor([[5, 9, 17, 33, 2, 8]]), torch.arange(6)[None]
    torch.compile(model, backend=record, dynamic=True, fullgraph=True)(
        input_ids=ids, position_ids=positions, use_cache=False)
    result = lower(graphs[0])
    calls = [line for line in mlir({"lowered": result.gm}).splitlines() if "torch.kvgraph.ragged_attention" in line]
    assert len(calls) == 2
    # the op's last three arguments: sliding_window, softcap, kv_scales (a float cache: none)
    args = [call[call.index("(") + 1: call.index(")")].split(", ")[-3:] for call in calls]
    assert args[0][0].startswith("%int4") and args[1][0].startswith("%none")  # sliding_window
    assert all(a[1].startswith("%float5.000000e01") for a in args)  # softcap
    assert all(a[2].startswith("%none") for a in args)  # kv_scales
    torch._dynamo.reset()
