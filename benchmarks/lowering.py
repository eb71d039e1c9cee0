"""Cost of the lowering pipeline on a deep Llama-shaped graph, next to the cost of capturing it.

Captures a ``LlamaForCausalLM`` with ``num_hidden_layers`` layers (tiny hidden size: the graph's
node count grows with depth, not width) once with Dynamo, then lowers fresh copies of that graph
``--runs`` times and prints JSON: the capture time (the baseline every ``torch.compile`` user
already pays), the median time of each pass and of the whole pipeline, and node counts.

    .venv/bin/python benchmarks/lowering.py --layers 32 --attn sdpa --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from kvgraph.passes import LoweringPipeline
from kvgraph.passes.graph_view import copy_module
from kvgraph.passes.pipeline import PASSES


def capture(layers: int, attn: str) -> tuple[torch.fx.GraphModule, float]:
    """The Dynamo graph of a tiny-width Llama with ``layers`` layers, and seconds to capture it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs: list):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=record, dynamic=True, fullgraph=True)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=torch.randint(0, 128, (1, 8)), position_ids=torch.arange(8)[None], use_cache=False)
    return graphs[0], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--strategy", choices=["paged", "continuous"], default="paged")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    gm, capture_s = capture(args.layers, args.attn)
    pipeline = LoweringPipeline(cache_strategy=args.strategy)
    totals, per_pass = [], {name: [] for name in PASSES}
    for _ in range(args.runs):
        fresh = copy_module(gm)
        start = time.perf_counter()
        result = pipeline(fresh)
        totals.append(time.perf_counter() - start)
        for name in PASSES:
            per_pass[name].append(result.timings[name])
    print(json.dumps({
        "model": f"LlamaForCausalLM(layers={args.layers}, hidden=64, heads=4, kv_heads=2, attn={args.attn})",
        "strategy": args.strategy,
        "runs": args.runs,
        "nodes_captured": len(gm.graph.nodes),
        "nodes_lowered": len(result.gm.graph.nodes),
        "sites": len(result.sites),
        "capture_s": round(capture_s, 4),
        "pipeline_s": round(statistics.median(totals), 4),
        "pipeline_vs_capture": round(statistics.median(totals) / capture_s, 4),
        "passes_s": {name: round(statistics.median(t), 4) for name, t in per_pass.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
