"""CPU serving in one process: kvgraph vs Hugging Face padded ``generate``, its matmul floor and the
machine's GEMM peak.

    python benchmarks/cpu_serving.py --model llama-56m [--dtype bfloat16] [--requests 64] [--repeats 3]

For each workload (``mixed``, ``decode-heavy``, ``shared-prefix``) it runs, in this order and
``--repeats`` times: kvgraph (compiled and warmed up once: the compiled graphs are the only thing a
repeat reuses), the matmul floor on the call shapes kvgraph recorded (``kvgraph/entrypoints/cli/floor.py``), and
HF ``generate`` on left-padded batches of ``--max-batch-size``. Every kvgraph repeat starts from an
empty prefix cache (``LLM.reset_prefix_cache``) and raises if a workload without shared prefixes
still hits it (``kvgraph/entrypoints/cli/bench.py::check_cold``), so no repeat is served by an earlier one;
``shared-prefix`` reports its hits inside the run and that nothing was cached before it. Greedy
outputs must agree with HF's (in bf16/fp16: or part only where the model's own rounding error covers
the gap, ``kvgraph/entrypoints/cli/divergence.py``) before any figure is printed. On ``shared-prefix`` a second
engine with prefix caching off runs the same prompts. Achieved GFLOP/s are the workload's FLOPs
(``kvgraph/entrypoints/cli/flops.py``) over wall time, beside a large GEMM's best rate measured before each repeat.
Reports medians over repeats and each ratio beside its target as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvgraph.entrypoints.cli.baselines import hf_generate
from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.cli.common import DTYPES
from kvgraph.entrypoints.cli.divergence import explain
from kvgraph.entrypoints.cli.floor import matmul_floor
from kvgraph.entrypoints.cli.flops import gemm_peak_gflops, workload_flops
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload

# (workload, new tokens): decode-heavy as the issue measures it, 32-token prompts and 128 new tokens
WORKLOADS = (("mixed", None), ("decode-heavy", 128), ("shared-prefix", None))
TARGETS = {
    "mixed": {"pct_of_nominal_peak_min": 60},
    "decode-heavy": {"pct_of_nominal_peak_min": 60},
    "shared-prefix": {"prefix_caching_speedup_min": 1.5},
}
TINY_TARGET = {"speedup_vs_hf_min": 1.0}


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def build(model, tokenizer, args, prefix_caching: bool = True) -> LLM:
    return LLM(
        model, tokenizer=tokenizer, max_batch_size=args.max_batch_size, max_seq_len=1024,
        enable_prefix_caching=prefix_caching, dtype=DTYPES.get(args.dtype),
        freeze_weights=False if args.no_freeze_weights else None,  # None: the engine's default (auto)
    )


def check_outputs(llm: LLM, workload, ours, theirs) -> dict:
    identical = sum(a == b for a, b in zip(ours.outputs, theirs.outputs, strict=True))
    divergences = explain(llm.model, workload.prompts, ours.outputs, theirs.outputs)
    unexplained = [d for d in divergences if not d["within_rounding"]]
    if unexplained:
        raise SystemExit(f"greedy outputs differ beyond rounding on {len(unexplained)} requests: {unexplained[:3]}")
    return {"identical": identical, "within_rounding": len(divergences), "requests": len(workload.prompts)}


def decode_step_ratio(llm: LLM, shapes: list[tuple[int, int]], stats: dict) -> float | None:
    """kvgraph's decode time per decode-only call over the floor of one such call (T == B)."""
    decode_calls = [s for s in shapes if s[0] == s[1]]
    if not decode_calls or not stats["decode_time_s"]:
        return None
    floor = matmul_floor(llm.model, decode_calls) / len(decode_calls)
    return (stats["decode_time_s"] / len(decode_calls)) / floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=64, help="mixed (the others use half)")
    parser.add_argument("--no-freeze-weights", action="store_true",
                        help="compile the weights as graph inputs (default: the engine's auto, which "
                        "freezes unless kvgraph packs every linear layer itself)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(w for w, _ in WORKLOADS))
    parser.add_argument("--nominal-peak-gflops", type=float,
                        help="the machine's nominal FLOP peak (e.g. 157 for 2 AVX2+FMA cores at 2.45 GHz)")
    args = parser.parse_args()

    model, tokenizer = load_preset(args.model)
    llm = build(model, tokenizer, args)
    tiny = sum(p.numel() for p in llm.model.parameters()) < 10_000_000
    llm.warmup()
    graphs_after_warmup = llm.stats()["compiled_graphs"]
    report = {
        "model": args.model, "dtype": str(llm.params.dtype), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "repeats": args.repeats, "workloads": {},
    }
    for name, new_tokens in WORKLOADS:
        if name not in args.workloads.split(","):
            continue
        n = args.requests if name == "mixed" else max(1, args.requests // 2)
        workload = make_workload(name, num_requests=n, vocab_size=llm.vocab_size, max_new_tokens=new_tokens)
        flops = workload_flops(llm.model, workload).total
        peaks = []
        runs = {"kvgraph_s": [], "floor_s": [], "hf_s": [], "decode_step_vs_floor": []}
        hits, cached_before = [], []
        for repeat in range(args.repeats):
            peaks.append(gemm_peak_gflops(llm.params.dtype))
            ours, shapes = run_kvgraph(llm, workload)
            stats = llm.stats()
            floor = matmul_floor(llm.model, shapes)
            theirs = hf_generate(llm.model, workload.prompts, workload.max_new_tokens, args.max_batch_size,
                                 llm.params, tokenizer.pad_token_id or 0)
            agreement = check_outputs(llm, workload, ours, theirs)
            runs["kvgraph_s"].append(ours.elapsed_s)
            runs["floor_s"].append(floor)
            runs["hf_s"].append(theirs.elapsed_s)
            runs["decode_step_vs_floor"].append(decode_step_ratio(llm, shapes, stats))
            hits.append(ours.prefix_hit_tokens)
            cached_before.append(ours.cached_before_tokens)
            log(f"{name} #{repeat}: kvgraph {ours.elapsed_s:.2f} s ({ours.prefix_hit_tokens} prefix-hit tokens), "
                f"floor {floor:.2f} s, hf {theirs.elapsed_s:.2f} s, outputs {agreement}")
        med = {k: statistics.median(v) for k, v in runs.items() if v and None not in v}
        gflops, peak = flops / med["kvgraph_s"] / 1e9, max(peaks)
        row = {
            "requests": n, "new_tokens": workload.max_new_tokens, "prompt_tokens": workload.prompt_tokens,
            **{k: round(v, 4) for k, v in med.items()},
            "kvgraph_s_runs": [round(t, 3) for t in runs["kvgraph_s"]],
            "kvgraph_vs_floor": round(med["kvgraph_s"] / med["floor_s"], 3),
            "speedup_vs_hf": round(med["hf_s"] / med["kvgraph_s"], 3),
            "speedup_vs_hf_runs": [round(h / k, 3) for h, k in zip(runs["hf_s"], runs["kvgraph_s"], strict=True)],
            "cached_before_run_tokens_runs": cached_before, "prefix_hit_tokens_runs": hits,
            "workload_gflop": round(flops / 1e9, 1), "kvgraph_gflops": round(gflops, 1),
            "hf_gflops": round(flops / med["hf_s"] / 1e9, 1), "gemm_peak_gflops": round(peak, 1),
            "pct_of_gemm_peak": round(100 * gflops / peak, 1),
            "outputs": agreement, "steps": stats["steps"],
        }
        if args.nominal_peak_gflops:
            row["pct_of_nominal_peak"] = round(100 * gflops / args.nominal_peak_gflops, 1)
        if name == "shared-prefix":
            off = build(model, tokenizer, args, prefix_caching=False)
            times = [run_kvgraph(off, workload)[0].elapsed_s for _ in range(args.repeats)]
            row["no_prefix_caching_s"] = round(statistics.median(times), 4)
            row["prefix_caching_speedup"] = round(row["no_prefix_caching_s"] / med["kvgraph_s"], 3)
            row["prefix_hit_rate"] = stats["prefix_hit_rate"]  # inside the run: the first request fills it
            del off
        row["targets"] = TINY_TARGET if tiny else TARGETS[name]
        report["workloads"][name] = row
        log(json.dumps({name: row}))
    report["compiled_graphs_after_warmup"] = graphs_after_warmup
    report["recompiles_after_warmup"] = llm.stats()["compiled_graphs"] - graphs_after_warmup
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
