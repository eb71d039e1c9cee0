import torch
from torch.utils.flop_counter import FlopCounterMode

from kvgraph.entrypoints.cli.flops import gemm_peak_gflops, workload_flops
from kvgraph.presets import load_preset
from kvgraph.workloads import Workload


def test_linear_flops_equal_what_torch_counts_for_the_tokens_fed_and_one_head_row_per_new_token():
    model, _ = load_preset("llama-tiny")
    prompt = list(range(3, 3 + 9))
    flops = workload_flops(model, Workload("one", [prompt], max_new_tokens=1))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.tensor([prompt]), logits_to_keep=1)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counts.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert flops.linear + flops.output_projection == matmuls


def test_attention_flops_count_causal_query_key_pairs_of_every_layer():
    model, _ = load_preset("llama-tiny")
    c = model.config
    flops = workload_flops(model, Workload("two", [[5, 6, 7], [8]], max_new_tokens=2))
    pairs = (4 * 5) // 2 + (2 * 3) // 2  # 4 and 2 tokens fed
    assert flops.attention == 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers * pairs


def test_gemm_peak_is_a_positive_rate():
    assert gemm_peak_gflops(size=64) > 0
