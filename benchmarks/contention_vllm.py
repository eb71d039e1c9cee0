"""kvgraph and vLLM's CPU build under the same load: a busy process on one of the two cores.

    python benchmarks/contention_vllm.py --model llama-56m [--workloads mixed,decode-heavy] [--repeats 2]

Both engines run the same checkpoint (``kvgraph.presets.save_preset``) and prompts (``make_workload``,
seed 0), fp32 weights and KV cache, greedy, exactly N new tokens, 2 threads, every request
submitted at once, prefix caching off. Each round runs, back to back: kvgraph quiet, vLLM quiet,
kvgraph contended, vLLM contended, where contended means a busy-loop process pinned to the last
core of this process's affinity set (``benchmarks/contention.py``'s). kvgraph is one engine with
its default settings (the thread governor on), compiled and warmed up once, and runs the workload
once untimed before the rounds; vLLM runs in its own virtualenv
(``benchmarks/peers/run_vllm_cpu.py`` says how to create it), a fresh process per run, with its
warm-up and one untimed run of the workload before the timed one (its build and warm-up run under
the same condition but are not timed). kvgraph's greedy outputs must be equal in every run; how
many of vLLM's requests equal kvgraph's token for token is reported (its own kernels round
differently, and random-weight models have near-ties). Reports medians, each engine's contended/quiet ratio and kvgraph's
throughput relative to vLLM's in each condition, as JSON. Target (issue 19): kvgraph never
behind vLLM-CPU under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from contention import busy_core, log
from peers import DEFAULT_CACHE, agreement, build_workload, peer_env, peer_request

from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset, save_preset

HERE = Path(__file__).resolve().parent
VLLM_SCRIPT = HERE / "peers" / "run_vllm_cpu.py"
DEFAULT_VLLM_PYTHON = Path("/work/peers/vllm/bin/python")
CONDITIONS = ("quiet", "contended")


def run_vllm(python: Path, hf_dir: Path, request: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        done = subprocess.run([str(python), str(VLLM_SCRIPT), "--model-dir", str(hf_dir), "--request", str(path)],
                              check=True, env=peer_env(), stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--workloads", default="mixed,decode-heavy")
    parser.add_argument("--requests", type=int, default=64, help="mixed (the others use half)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="the checkpoint, by model")
    args = parser.parse_args()
    if not args.vllm_python.is_file():
        raise SystemExit(f"no {args.vllm_python}: create vLLM's virtualenv as benchmarks/peers/run_vllm_cpu.py says")
    threads = torch.get_num_threads()
    hf_dir = args.cache_dir / args.model / "hf"
    save_preset(args.model, hf_dir)
    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=64, max_seq_len=1024, enable_prefix_caching=False,
              progress=False)
    llm.warmup()
    core = max(os.sched_getaffinity(0))
    report = {"model": args.model, "threads": threads, "busy_core": core, "repeats": args.repeats, "workloads": {}}
    for name in args.workloads.split(","):
        workload = build_workload(name, args.requests, llm.vocab_size, None)
        request = peer_request(workload, max_batch_size=64, threads=threads)
        reference = run_kvgraph(llm, workload)[0].outputs  # untimed: oneDNN's first sight of each shape
        times = {(engine, c): [] for engine in ("kvgraph", "vllm") for c in CONDITIONS}
        same = {c: [] for c in CONDITIONS}  # vLLM's requests with kvgraph's exact greedy output, per run
        for repeat in range(args.repeats):
            for condition in CONDITIONS:
                for engine in ("kvgraph", "vllm"):
                    with busy_core(core) if condition == "contended" else contextlib.nullcontext():
                        if engine == "kvgraph":
                            result, _ = run_kvgraph(llm, workload)
                            seconds, outputs = result.elapsed_s, result.outputs
                        else:
                            done = run_vllm(args.vllm_python, hf_dir, request)
                            seconds, outputs = done["wall_s"], done["outputs"]
                    if engine == "kvgraph" and outputs != reference:
                        raise SystemExit(f"kvgraph {condition}: greedy outputs differ from its first run")
                    if engine == "vllm":
                        same[condition].append(agreement(reference, outputs)["identical_requests"])
                    times[(engine, condition)].append(seconds)
                    log(f"{name} #{repeat} {engine} {condition}: {seconds:.2f} s")
        med = {key: statistics.median(v) for key, v in times.items()}
        report["workloads"][name] = {
            "requests": len(workload.prompts), "new_tokens": workload.max_new_tokens,
            "seconds": {f"{e}-{c}": round(v, 3) for (e, c), v in med.items()},
            "runs": {f"{e}-{c}": [round(t, 3) for t in v] for (e, c), v in times.items()},
            "contended_vs_quiet": {e: round(med[(e, "quiet")] / med[(e, "contended")], 3) for e in ("kvgraph", "vllm")},
            "kvgraph_vs_vllm_throughput": {c: round(med[("vllm", c)] / med[("kvgraph", c)], 3) for c in CONDITIONS},
            "vllm_requests_identical_to_kvgraph": same, "kvgraph_outputs_equal_across_runs": True,
            "target": {"kvgraph_vs_vllm_contended_min": 1.0},
        }
    report["kvgraph_recompiles"] = llm.runner.recompiles
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
