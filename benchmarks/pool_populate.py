"""The CPU cache pool mapped as steps first write it (``KVGRAPH_POOL_POPULATE=lazy``) or up front
(``eager``): how soon an engine is ready, and what its first run costs, in fresh processes.

    python benchmarks/pool_populate.py --model llama-56m --workloads mixed,decode-heavy --pairs 3

Each process builds the preset, times ``LLM(model)`` plus ``warmup()`` (``ready_s``; the compiled
graphs come from the precompiled files an untimed process wrote first), then one ``generate`` of
the workload from an empty prefix cache (``run_s``): the run pays for every page of the pool it is
the first to write. The modes alternate process by process; prints JSON with each pair's
lazy / eager ratios and their medians (this kind of host drifts by 40 %: read the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("lazy", "eager")


def child(model_name: str, workload_name: str) -> dict:
    from kvgraph.engine import SamplingParams
    from kvgraph.entrypoints.llm import LLM
    from kvgraph.presets import load_preset
    from kvgraph.workloads import make_workload

    model, tokenizer = load_preset(model_name)
    began = time.perf_counter()
    llm = LLM(model, tokenizer=tokenizer)
    llm.warmup()
    ready = time.perf_counter() - began
    requests = 64 if workload_name == "mixed" else 32
    workload = make_workload(workload_name, num_requests=requests, vocab_size=llm.vocab_size)
    sampling = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    began = time.perf_counter()
    llm.generate(workload.prompts, sampling)
    return {"ready_s": round(ready, 3), "run_s": round(time.perf_counter() - began, 3)}


def run_child(mode: str, model: str, workload: str) -> dict:
    env = {**os.environ, "KVGRAPH_POOL_POPULATE": mode}
    out = subprocess.run([sys.executable, __file__, "--child", model, workload], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--workloads", default="mixed,decode-heavy")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    results = {}
    for workload in args.workloads.split(","):
        run_child("lazy", args.model, workload)  # untimed: compiles and writes the precompiled files
        pairs = [{mode: run_child(mode, args.model, workload) for mode in MODES} for _ in range(args.pairs)]
        ready = [p["lazy"]["ready_s"] / p["eager"]["ready_s"] for p in pairs]
        run = [p["lazy"]["run_s"] / p["eager"]["run_s"] for p in pairs]
        results[workload] = {
            "pairs": pairs,
            "ready_lazy_over_eager": [round(r, 3) for r in ready],
            "run_lazy_over_eager": [round(r, 3) for r in run],
            "median_ready_ratio": round(statistics.median(ready), 3),
            "median_run_ratio": round(statistics.median(run), 3),
        }
    print(json.dumps({"model": args.model, "results": results}, indent=2))


if __name__ == "__main__":
    main()
