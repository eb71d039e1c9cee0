"""Where an engine run spends its time: a workload through ``kvgraph.LLM`` under torch.profiler, as JSON.

    python benchmarks/profile_engine.py --model llama-56m --workload mixed --requests 64 [--dtype bfloat16]

Warms up (compiles) first, then profiles the timed run only. Prints the wall time, the share
of it spent in the top operators (self time on the calling thread, which includes the
intra-op threads it waits for) and the time outside any operator (Python: scheduler, fetch,
bind, the sampling glue).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.cli.common import DTYPES
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--num-steps", type=int, default=1)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, dtype=DTYPES.get(args.dtype), num_steps=args.num_steps)
    workload = make_workload(
        args.workload, num_requests=args.requests, vocab_size=llm.vocab_size, max_new_tokens=args.max_new_tokens
    )
    llm.warmup()
    sampling = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(workload.prompts, sampling)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    print(json.dumps({
        "model": args.model, "workload": args.workload, "requests": args.requests,
        "dtype": str(llm.params.dtype), "threads": torch.get_num_threads(), "wall_s": round(wall, 3),
        "steps": llm.stats()["steps"],
        "ops": [
            {"op": e.key, "calls": e.count, "share_of_wall": round(e.self_cpu_time_total / 1e6 / wall, 4)}
            for e in top
        ],
        "outside_ops_share": round(max(0.0, 1 - total_self / wall), 4),
    }, indent=2))


if __name__ == "__main__":
    main()
