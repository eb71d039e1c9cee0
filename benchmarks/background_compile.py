"""What serving costs while a worker process compiles: one engine with ``background_compile`` on an
empty Inductor cache, running a workload back to back from its ready moment until the worker's
graphs load, then the same workload compiled.

    python benchmarks/background_compile.py --model llama-56m --workload decode-heavy

Prefix caching is off, so no run reuses what an earlier one left in the cache. ``during_s`` are
the runs while the worker compiled (the lowered graph uncompiled, the worker on the same cores; the
run that saw it finish includes loading its graphs), ``after_s`` the runs after. Times are from
this process's start. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

STARTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--workload", default="decode-heavy")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--after", type=int, default=3, help="compiled runs after the switch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgraph-bg-") as cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before torch reads it; the worker inherits it
        print(json.dumps(measure(args), indent=2))


def measure(args: argparse.Namespace) -> dict:
    from kvgraph.entrypoints.cli.bench import run_kvgraph
    from kvgraph.entrypoints.llm import LLM
    from kvgraph.presets import load_preset
    from kvgraph.workloads import make_workload

    def since_start() -> float:
        return round(time.perf_counter() - STARTED, 1)

    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, background_compile=True, max_batch_size=64, max_seq_len=1024,
              enable_prefix_caching=False, progress=False)
    try:
        llm.warmup()
        ready = since_start()
        workload = make_workload(args.workload, num_requests=args.requests, vocab_size=llm.vocab_size,
                                 max_new_tokens=args.new_tokens)
        during, outputs = [], None
        while llm.compiling_in_background:
            result, _ = run_kvgraph(llm, workload)
            during.append(round(result.elapsed_s, 3))
            outputs = outputs or result.outputs
        llm.wait_for_compile()
        compiled = since_start()
        after = []
        for _ in range(args.after):
            result, _ = run_kvgraph(llm, workload)
            after.append(round(result.elapsed_s, 3))
        same = outputs is None or result.outputs == outputs
    finally:
        llm.close()
    return {
        "model": args.model, "workload": args.workload, "ready_s": ready, "compiled_s": compiled,
        "during_s": during, "after_s": after, "outputs_equal": same,
        "during_vs_after": round(statistics.median(during) / statistics.median(after), 2) if during else None,
    }


if __name__ == "__main__":
    main()
