"""``kvgraph bench``: one workload through kvgraph and, in the same run, Hugging Face ``generate``
(padded batches) and ``generate_batch`` (continuous batching); greedy outputs must agree. The matmul
floor (``kvgraph.entrypoints.cli.floor``) says how close kvgraph comes to its model's linear layers alone."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from kvgraph.entrypoints.cli.baselines import SystemResult, hf_generate, hf_generate_batch
from kvgraph.entrypoints.cli.common import (
    add_engine_args,
    add_model_args,
    build_llm,
    plural,
    positive_int,
    unsharded_model,
)
from kvgraph.entrypoints.cli.divergence import NOISE_FACTOR, explain
from kvgraph.entrypoints.cli.floor import FLOOR_DESCRIPTION, matmul_floor
from kvgraph.entrypoints.cli.flops import PEAK_SIZE, gemm_peak_gflops, workload_flops
from kvgraph.entrypoints.cli.heap import freeze_warm_heap
from kvgraph.entrypoints.cli.report import (
    SPEEDUP_LEGEND,
    agreement,
    format_table,
    plot,
    summarize,
    summarize_floor,
    ttft_note,
)
from kvgraph.errors import ConfigError, WarmCacheError
from kvgraph.workloads import WORKLOADS, Workload, make_workload

BASELINES = ("hf-generate", "hf-generate-batch")


def add_parser(subparsers) -> None:
    described = "; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values())
    p = subparsers.add_parser(
        "bench", help="benchmark a workload against Hugging Face baselines",
        description="Run a named workload through kvgraph, Hugging Face generate (padded batches) and "
        "generate_batch (continuous batching) with greedy decoding and a fixed output length; check that "
        "the outputs agree; report throughput, kvgraph's speed-up over each system, time to first token, "
        "inter-token latency percentiles, peak KV memory and KV waste, and the matmul floor: the time "
        "the model's linear layers alone take on the tokens of kvgraph's run, each call's new tokens "
        f"(the output projection on one token per sequence). Workloads: {described}.",
    )
    add_model_args(p)
    p.add_argument("--workload", choices=list(WORKLOADS), default="mixed", help="default: mixed")
    p.add_argument("--requests", type=positive_int, default=32, help="number of prompts (default 32)")
    p.add_argument("--max-new-tokens", type=positive_int, help="override the workload's output length")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated subset of {', '.join(BASELINES)}, or none (default: both)")
    p.add_argument("--hf-batch-size", type=positive_int,
                   help="batch size of the padded generate baseline (default: --max-batch-size)")
    p.add_argument("--no-floor", action="store_true", help="skip the matmul floor")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even if a baseline's greedy outputs differ from kvgraph's")
    p.add_argument("--json", dest="json_out", type=Path, metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="write a PNG chart of the results")
    p.add_argument("--no-progress", action="store_true", help="no compile stages on stderr")
    add_engine_args(p)
    p.set_defaults(run=run)


def parse_baselines(text: str) -> list[str]:
    names = [] if text.strip() == "none" else [t for t in text.replace(" ", "").split(",") if t]
    for name in names:
        if name not in BASELINES:
            raise ConfigError(f"unknown baseline {name!r}; expected a subset of {', '.join(BASELINES)}")
    return names


def run_kvgraph(llm, workload: Workload) -> tuple[SystemResult, list[tuple[int, int]]]:
    """Warm up (compile), forget every cached prefix, then run the workload with EOS ignored.
    Returns the result and the ``(new tokens, sequences)`` of every model call of the timed run.

    The run starts from an empty prefix cache, so a repeat is never served by what an earlier run
    (or the warm-up) left behind: ``WarmCacheError`` if it would be. Hits inside the run (the
    shared system prompt of ``shared-prefix``; with a small vocabulary, prompts that begin alike by
    chance) are counted in ``prefix_hit_tokens``."""
    from kvgraph.engine import SamplingParams

    llm.warmup()
    freeze_warm_heap()  # in the kvgraph command's own process only
    llm.reset_prefix_cache()
    llm.reset_stats()
    cached_before = llm.manager.cached_prefix_tokens
    sampling = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    with llm.runner.record_shapes() as call_shapes:
        start = time.perf_counter()
        completions = llm.generate(workload.prompts, sampling)
        elapsed = time.perf_counter() - start
    stats = llm.stats()
    result = SystemResult(
        "kvgraph", [c.token_ids for c in completions], elapsed,
        ttft_s=[c.token_times[0] - start for c in completions],
        itl_s=[x for c in completions for x in c.inter_token_latencies],
        kv_allocated_bytes=stats["kv_allocated_bytes"], kv_peak_bytes=stats["kv_peak_bytes"],
        kv_waste=stats["kv_waste"], cached_before_tokens=cached_before,
        prefix_hit_tokens=stats["prefix_hit_tokens"],
    )
    check_cold(workload, result)
    return result, call_shapes


def check_cold(workload: Workload, result: SystemResult) -> None:
    """Raise ``WarmCacheError`` if the timed run of ``workload`` began with prefixes in the cache:
    its hits would then be what an earlier run left, not what the workload itself shares."""
    if result.cached_before_tokens:
        raise WarmCacheError(
            f"the timed run of {workload.name!r} began with {result.cached_before_tokens} tokens in the "
            "prefix cache; its figure would measure what an earlier run left"
        )


def run(args: argparse.Namespace) -> int:
    baselines = parse_baselines(args.baselines)
    llm = build_llm(args, progress=not args.no_progress)
    if llm is None:
        return 0
    if llm.vocab_size is None:
        raise ConfigError(f"model {args.model!r} has no config.vocab_size to draw prompt tokens from")
    workload = make_workload(
        args.workload, num_requests=args.requests, vocab_size=llm.vocab_size, seed=args.workload_seed,
        max_new_tokens=args.max_new_tokens,
    )
    if workload.max_seq_len > args.max_seq_len:
        raise ConfigError(
            f"workload {workload.name!r} reaches {workload.max_seq_len} tokens, past --max-seq-len={args.max_seq_len}"
        )
    log = _Log()
    log(f"workload {workload.name}: {plural(len(workload.prompts), 'request')}, {workload.prompt_tokens} prompt tokens, "
        f"{workload.max_new_tokens} new tokens each")
    kvgraph, call_shapes = run_kvgraph(llm, workload)
    llm.close()
    model = unsharded_model(args, llm)
    results = [kvgraph]
    stats = llm.stats()
    log(f"kvgraph: {kvgraph.tokens_per_s:.1f} tok/s over {len(call_shapes)} model calls "
        f"({stats['warmup_graphs']} graph{'' if stats['warmup_graphs'] == 1 else 's'} compiled in warm-up, "
        f"{stats['recompiles']} recompiles after it)")
    floor_s = None
    if not args.no_floor:
        floor_s = matmul_floor(model, call_shapes)
        log(f"matmul floor: {kvgraph.new_tokens / floor_s:.1f} tok/s")
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    for name in baselines:
        if name == "hf-generate":
            result = hf_generate(
                model, workload.prompts, workload.max_new_tokens,
                args.hf_batch_size or args.max_batch_size, llm.params, pad_id,
            )
        else:
            result = hf_generate_batch(
                model, workload.prompts, workload.max_new_tokens, num_pages=_pool_pages(llm, args.page_size),
                page_size=args.page_size, max_batch_size=args.max_batch_size,
                max_batch_tokens=args.max_batch_tokens, params=llm.params, pad_id=pad_id,
            )
        log(f"{name}: {result.tokens_per_s:.1f} tok/s")
        results.append(result)
    rows = [summarize(r, kvgraph) for r in results]
    if floor_s is not None:
        rows.append(summarize_floor(floor_s, kvgraph))
    agree = [agreement(kvgraph, r) for r in results[1:]]
    for a, result in zip(agree, results[1:], strict=True):
        if a["identical"] != a["requests"]:
            log(f"explaining {a['requests'] - a['identical']} mismatches vs {a['system']} with the model's own logits")
            a["divergences"] = explain(model, workload.prompts, kvgraph.outputs, result.outputs)
            a["within_rounding"] = sum(d["within_rounding"] for d in a["divergences"])
    compute = compute_report(model, workload, results, llm.params.dtype)
    vs_floor = kvgraph.elapsed_s / floor_s if floor_s is not None else None
    notes = [n for n in map(ttft_note, results) if n is not None]
    print(format_table(rows))
    print(SPEEDUP_LEGEND)
    for note in notes:
        print(note)
    if vs_floor is not None:
        floor_text = f"{floor_s:.2f} s" if floor_s >= 1 else f"{floor_s * 1e3:.2f} ms"
        print(f"kvgraph: {vs_floor:.2f}x the matmul floor (floor {floor_text}: {FLOOR_DESCRIPTION})")
    for line in compute_lines(compute):
        print(line)
    for a in agree:
        print(agreement_text(a))
    report = {
        "model": args.model, "workload": workload.name, "requests": len(workload.prompts),
        "max_new_tokens": workload.max_new_tokens, "device": str(llm.device), "dtype": str(llm.params.dtype),
        "torch_threads": torch.get_num_threads(), "cache": args.cache,
        "results": [dataclasses.asdict(r) for r in rows],
        "kvgraph_vs_floor": vs_floor, "compute": compute, "agreement": agree, "notes": notes, "kvgraph_stats": llm.stats(),
    }
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
        log(f"wrote {args.json_out}")
    if args.plot is not None:
        plot(rows, f"{args.model} / {workload.name} ({len(workload.prompts)} requests)", args.plot)
        log(f"wrote {args.plot}")
    mismatched = [a["system"] for a in agree if a["identical"] + a.get("within_rounding", 0) != a["requests"]]
    if mismatched and not args.allow_mismatch:
        print(f"kvgraph bench: error: greedy outputs differ from kvgraph's for {', '.join(mismatched)} "
              "other than at near-ties of the model's own logits (--allow-mismatch accepts this)", file=sys.stderr)
        return 1
    return 0


def compute_report(model, workload: Workload, results: list[SystemResult], dtype: torch.dtype) -> dict:
    """The workload's FLOPs, a large GEMM's GFLOP/s measured now (the machine's practical peak), and
    each system's achieved GFLOP/s and share of that peak."""
    flops = workload_flops(model, workload)
    peak = gemm_peak_gflops(dtype)
    systems = {}
    for r in results:
        achieved = flops.total / r.elapsed_s / 1e9
        systems[r.name] = {"gflops": achieved, "pct_of_gemm_peak": 100 * achieved / peak}
    return {
        "workload_gflop": flops.total / 1e9, "linear_gflop": flops.linear / 1e9,
        "output_projection_gflop": flops.output_projection / 1e9, "attention_gflop": flops.attention / 1e9,
        "gemm_peak_gflops": peak, "systems": systems,
    }


def compute_lines(compute: dict) -> list[str]:
    """``SYSTEM: X GFLOP/s, Y% of the GEMM peak`` per system, after one line on the workload."""
    lines = [f"workload: {compute['workload_gflop']:.1f} GFLOP; a {PEAK_SIZE}^3 GEMM ran at "
             f"{compute['gemm_peak_gflops']:.1f} GFLOP/s in this process (the practical peak)"]
    for name, s in compute["systems"].items():
        lines.append(f"{name}: {s['gflops']:.1f} GFLOP/s achieved, {s['pct_of_gemm_peak']:.0f}% of that peak")
    return lines


def agreement_text(a: dict) -> str:
    """``greedy outputs vs SYSTEM: ...``: identical requests, and how the others part."""
    text = f"greedy outputs vs {a['system']}: {a['identical']}/{a['requests']} requests identical"
    divergences = a.get("divergences")
    if not divergences:
        return text
    tie = a["within_rounding"]
    text += (f"; {tie} part where both tokens' logits are within {NOISE_FACTOR:g}x the model's own rounding "
             f"error (or one ulp) of the best, {len(divergences) - tie} otherwise")
    worst = next((d for d in divergences if not d["within_rounding"]), None)
    if worst is not None:
        text += (f" (request {worst['request']} token {worst['token']}: kvgraph {worst['ours']}, "
                 f"{a['system']} {worst['theirs']}, logit gaps to the best {_gap(worst['gap_ours'])} / "
                 f"{_gap(worst['gap_theirs'])}, rounding error {worst['noise']:.3g})")
    return text


def _gap(gap: float | None) -> str:
    return "n/a" if gap is None else f"{gap:.3g}"


def _pool_pages(llm, page_size: int) -> int:
    """The page count of kvgraph's pool, or what its continuous slots amount to in pages of ``page_size``."""
    manager = llm.manager
    if hasattr(manager, "total_pages"):
        return manager.total_pages
    return manager.max_batch_size * -(-manager.max_seq_len // page_size)


class _Log:
    """Progress lines on stderr, stamped with seconds since the start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {text}", file=sys.stderr)
