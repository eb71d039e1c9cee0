"""Steps of one new token on the graph of several tokens, or on a graph of their own, in one process.

    python benchmarks/one_graph.py --model llama-56m [--repeats 7] [--decode-tokens 256] [--variants fp32,int8]

A precompiled model on the CPU runs its steps of one new token (``T == 1``: batch-1 decode, the
tail of a batch) on its graph of several tokens (``CompiledModel.one_graph``), so a first start
compiles one graph instead of two. This measures what that costs those steps: two engines of the
same seeded weights and settings, ``one_graph`` (the default) and ``two_graphs`` (``one_graph``
set to ``False`` before the first call: Dynamo's own graph for ``T == 1``), both precompiled and
warmed up before timing (their compiled graphs are warm-up), decode one 32-token prompt for
``--decode-tokens`` tokens, taking turns in every repeat (the order alternates), each run from an
empty prefix cache. Reports each run's decode tokens/s (decode steps only, from the engine's
stats), medians, the per-pair ratios, and whether the greedy tokens are equal (in bfloat16 two
graphs may round differently; then the leading tokens that agree). Variants: ``fp32`` (the preset
as built) and ``int8`` (int8 weights with the vocabulary projection, bfloat16 activations).
Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.cli.quality import agreement
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset

VARIANTS = {
    "fp32": {},
    "int8": {"dtype": torch.bfloat16, "quantization": "int8-weight-only", "quantize_lm_head": True},
}
PROMPT = list(range(5, 37))


def engine(model_name: str, settings: dict, one_graph: bool) -> LLM:
    model, tokenizer = load_preset(model_name)  # seeded: the same weights for every engine
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=8, max_seq_len=1024, progress=False, **settings)
    if not llm.compiled.one_graph and one_graph:
        raise SystemExit(f"{model_name} with {settings} is not precompiled on the CPU: it has no one-graph path")
    llm.compiled.one_graph = one_graph
    llm.warmup()
    return llm


def decode(llm: LLM, tokens: int) -> tuple[float, list[int]]:
    llm.reset_prefix_cache()
    llm.reset_stats()
    done = llm.generate([PROMPT], SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    return llm.stats()["decode_tokens_per_s"], done[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--variants", default="fp32,int8")
    args = parser.parse_args()
    report = {"model": args.model, "threads": torch.get_num_threads(), "decode_tokens": args.decode_tokens,
              "variants": {}}
    for variant in args.variants.split(","):
        settings = VARIANTS[variant]
        engines = {"one_graph": engine(args.model, settings, True), "two_graphs": engine(args.model, settings, False)}
        graphs = {name: llm.stats()["compiled_graphs"] for name, llm in engines.items()}
        for llm in engines.values():
            decode(llm, 8)  # untimed: the first steps of each engine after its warm-up
        rates: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[int]] = {}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                rate, ids = decode(engines[name], args.decode_tokens)
                rates[name].append(rate)
                tokens.setdefault(name, ids)
            print(f"{variant} repeat {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in engines),
                  file=sys.stderr)
        one, two = rates["one_graph"], rates["two_graphs"]
        report["variants"][variant] = {
            "compiled_graphs": graphs,
            "decode_tokens_per_s": {name: [round(x, 1) for x in xs] for name, xs in rates.items()},
            "median_tokens_per_s": {name: round(statistics.median(xs), 1) for name, xs in rates.items()},
            "one_vs_two_median": round(statistics.median(one) / statistics.median(two), 3),
            "one_vs_two_pairs": [round(a / b, 3) for a, b in zip(one, two, strict=True)],
            "tokens_equal": tokens["one_graph"] == tokens["two_graphs"],
            "leading_tokens_equal": agreement(tokens["one_graph"], tokens["two_graphs"]),
        }
        for llm in engines.values():
            llm.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
