"""kvgraph on a shared CPU: throughput with a busy process on one core vs the quiet machine.

    python benchmarks/contention.py --model llama-56m [--workloads mixed,decode-heavy] [--repeats 3]

One engine, compiled and warmed up once, runs each workload in rounds; every round runs four
conditions back to back: quiet and contended (a busy-loop process pinned to the last core of this
process's affinity set), each with the thread governor on (``adaptive``, the default: threads
follow the cores left free, ``kvgraph/engine/threads.py``) and off (``fixed``,
``--no-adaptive-threads``: the thread count the engine started with). Every run starts from an
empty prefix cache. Greedy outputs must be equal in every condition before any figure is printed.
Reports each condition's median seconds and its throughput relative to the quiet adaptive run, and
the graphs compiled after warm-up (``recompiles``: a thread count set where Dynamo's guards see it
would re-trace), as JSON; the target is >= 0.45 contended.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from kvgraph.engine.threads import ThreadGovernor
from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.llm import LLM
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload

NEW_TOKENS = {"decode-heavy": 128}  # decode-heavy as the CPU serving benchmark measures it
CONDITIONS = ("quiet-adaptive", "quiet-fixed", "contended-adaptive", "contended-fixed")
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@contextmanager
def busy_core(core: int):
    """A process spinning on ``core`` for the duration of the block."""
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(core)])
    try:
        time.sleep(0.5)  # let it start spinning
        yield
    finally:
        hog.kill()
        hog.wait()


def run(llm: LLM, workload, governor: ThreadGovernor | None, threads: int):
    llm.threads = governor
    torch.set_num_threads(threads)
    result, _ = run_kvgraph(llm, workload)
    stats = llm.stats()
    return result, stats["threads"], stats["others_cores"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--requests", type=int, default=64, help="mixed (the others use half)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="mixed,decode-heavy")
    args = parser.parse_args()

    threads = torch.get_num_threads()  # before the engine's governor can lower it
    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=64, max_seq_len=1024)
    llm.warmup()
    core = max(os.sched_getaffinity(0))
    report = {"model": args.model, "threads": threads, "busy_core": core, "repeats": args.repeats, "workloads": {}}
    for name in args.workloads.split(","):
        n = args.requests if name == "mixed" else max(1, args.requests // 2)
        workload = make_workload(name, num_requests=n, vocab_size=llm.vocab_size, max_new_tokens=NEW_TOKENS.get(name))
        times = {c: [] for c in CONDITIONS}
        seen = {c: [] for c in CONDITIONS}  # (threads at the end, cores others took) per run
        outputs = None
        for repeat in range(args.repeats):
            for condition in CONDITIONS:
                governor = ThreadGovernor(threads) if condition.endswith("adaptive") else None
                if condition.startswith("contended"):
                    with busy_core(core):
                        result, now, others = run(llm, workload, governor, threads)
                else:
                    result, now, others = run(llm, workload, governor, threads)
                if outputs is None:
                    outputs = result.outputs
                elif result.outputs != outputs:
                    raise SystemExit(f"{condition}: greedy outputs differ from the first run's")
                times[condition].append(result.elapsed_s)
                seen[condition].append((now, None if others is None else round(others, 2)))
                log(f"{name} #{repeat} {condition}: {result.elapsed_s:.2f} s, threads {now}, others {others}")
        med = {c: statistics.median(t) for c, t in times.items()}
        quiet = med["quiet-adaptive"]
        report["workloads"][name] = {
            "requests": n, "new_tokens": workload.max_new_tokens,
            "seconds": {c: round(v, 3) for c, v in med.items()},
            "runs": {c: [round(t, 3) for t in v] for c, v in times.items()},
            "throughput_vs_quiet": {c: round(quiet / v, 3) for c, v in med.items()},
            "threads_and_others_cores": seen,
            "target": {"contended_vs_quiet_min": 0.45},
        }
    torch.set_num_threads(threads)
    report["recompiles"] = llm.runner.recompiles
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
