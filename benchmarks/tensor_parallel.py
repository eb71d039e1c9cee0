"""Tensor parallelism on this machine: the memory split, the communication and the step time of TP=2 vs TP=1.

    python benchmarks/tensor_parallel.py [--models llama-tiny,llama-56m] [--requests 8] [--new-tokens 16]
                                         [--repeats 3] [--compile eager]

For each model, one engine in this process (TP=1), then one of 2 ranks (this process is rank 0,
rank 1 is spawned; gloo over loopback), each running the seeded ``mixed`` workload ``--repeats``
times after a warm-up. Greedy outputs of the two must be equal before any figure is printed.
Reported as JSON, per model:

- ``kv_bytes``: the KV pool of one rank vs one process (same ``kv_cache_memory`` over all ranks);
- ``param_bytes``: the parameters one rank holds (its shards, the replicated rest) vs the model;
- ``all_reduce``: per model call, ``2 x layers x tokens x hidden x dtype bytes`` computed from the
  model's config and the call shapes of the run, checked against the bytes of the ``gloo:all_reduce``
  calls rank 0 made (``torch.profiler``, one repeat), and the same per token;
- ``tp1`` / ``tp2``: median seconds of the run, per step, and generated tokens/s.

On a 2-core CPU TP=2 is expected to be slower (each rank gets one thread and every layer waits
for two all-reduces): the figures are about correctness and the memory split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload

MAX_SEQ_LEN = 256
MAX_BATCH_SIZE = 8


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (a DTensor's local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def timed_runs(llm: LLM, prompts: list[list[int]], sampling: SamplingParams, repeats: int) -> dict:
    """Median seconds, seconds per step and tokens/s over ``repeats`` runs; the outputs of the last."""
    llm.warmup()
    times, steps = [], []
    for _ in range(repeats):
        llm.reset_stats()
        start = time.perf_counter()
        done = llm.generate(prompts, sampling)
        times.append(time.perf_counter() - start)
        log(f"run {len(times)}: {times[-1]:.3f} s")
        steps.append(llm.stats()["steps"])
    seconds = statistics.median(times)
    tokens = sum(len(c.token_ids) for c in done)
    return {
        "outputs": [c.token_ids for c in done],
        "seconds": round(seconds, 4),
        "step_ms": round(1e3 * seconds / statistics.median(steps), 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def counted_all_reduces(llm: LLM, prompts: list[list[int]], sampling: SamplingParams) -> tuple[int, int, list]:
    """One more run under the profiler: (all-reduce calls, bytes all-reduced by rank 0, call shapes)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, \
            llm.runner.record_shapes() as shapes:
        llm.generate(prompts, sampling)
    calls = [e for e in prof.events() if e.name == "gloo:all_reduce"]
    nbytes = sum(torch.Size(e.input_shapes[0]).numel() for e in calls) * llm.params.dtype.itemsize
    return len(calls), nbytes, list(shapes)


def measure(name: str, args: argparse.Namespace) -> dict:
    model, _ = load_preset(name)
    cfg = model.config
    workload = make_workload("mixed", num_requests=args.requests, vocab_size=cfg.vocab_size,
                             max_new_tokens=args.new_tokens)
    sampling = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    engine = dict(compile=args.compile, max_batch_size=MAX_BATCH_SIZE, max_seq_len=MAX_SEQ_LEN, progress=False,
                  enable_prefix_caching=False)  # every repeat prefills its prompts
    threads = torch.get_num_threads()

    one = LLM(model, **engine)
    whole_kv = one.manager.blocks.numel() * one.manager.blocks.element_size()
    whole_params = param_bytes(one.model)
    tp1 = timed_runs(one, workload.prompts, sampling, args.repeats)
    log(f"{name} TP=1: {tp1['seconds']} s")
    del one

    two = LLM(load_preset(name)[0], tensor_parallel_size=2, **engine)
    try:
        rank_kv = two.manager.blocks.numel() * two.manager.blocks.element_size()
        rank_params = param_bytes(two.model)
        tp2 = timed_runs(two, workload.prompts, sampling, args.repeats)
        log(f"{name} TP=2: {tp2['seconds']} s")
        calls, counted, shapes = counted_all_reduces(two, workload.prompts, sampling)
        dtype_bytes = two.params.dtype.itemsize
    finally:
        two.close()
        torch.set_num_threads(threads)
    if tp1.pop("outputs") != tp2.pop("outputs"):
        raise SystemExit(f"{name}: greedy outputs of TP=2 differ from one process")

    tokens = sum(t for t, _ in shapes)
    per_token = 2 * cfg.num_hidden_layers * cfg.hidden_size * dtype_bytes
    expected = per_token * tokens
    if counted != expected or calls != 2 * cfg.num_hidden_layers * len(shapes):
        raise SystemExit(f"{name}: rank 0 all-reduced {counted} bytes in {calls} calls; the model says {expected} "
                         f"bytes in {2 * cfg.num_hidden_layers * len(shapes)}")
    return {
        "requests": len(workload.prompts), "prompt_tokens": workload.prompt_tokens,
        "new_tokens": workload.max_new_tokens, "dtype": str(two.params.dtype), "outputs_equal": True,
        "kv_bytes": {"one_process": whole_kv, "per_rank": rank_kv, "ratio": round(rank_kv / whole_kv, 3)},
        "param_bytes": {"model": whole_params, "per_rank": rank_params,
                        "ratio": round(rank_params / whole_params, 3)},
        "all_reduce": {
            "formula": "2 x layers x tokens x hidden x dtype bytes",
            "bytes_per_token": per_token, "model_calls": len(shapes), "tokens": tokens,
            "bytes_per_call_mean": round(expected / len(shapes)), "expected_bytes": expected,
            "counted_bytes": counted, "counted_calls": calls,
        },
        "tp1": tp1, "tp2": tp2,
        "tp2_vs_tp1_step_time": round(tp2["step_ms"] / tp1["step_ms"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-tiny,llama-56m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", choices=("eager", "inductor"), default="eager")
    args = parser.parse_args()
    report = {"threads": torch.get_num_threads(), "torch": torch.__version__, "compile": args.compile,
              "repeats": args.repeats, "workload": "mixed", "models": {}}
    for name in args.models.split(","):
        report["models"][name] = measure(name, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
