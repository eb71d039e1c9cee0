"""Start-up to first tokens: a first start (empty Inductor cache) and a second one (the cache the
first left), for each ``--freeze`` setting (``--freeze-weights`` on, off or auto: the default,
off for a float32 model on the CPU), each start a fresh process.

    python benchmarks/startup.py --model llama-56m --freeze on,off

Each start runs ``kvgraph generate --model M --prompt hello --max-new-tokens 4 --json`` with its
own ``TORCHINDUCTOR_CACHE_DIR`` (fresh per setting, shared by that setting's two starts), and
reports the wall time of the process and the engine's own warm-up seconds and Inductor cache
hits from its JSON. The C++ attention kernel is built before the first timed start (its build is
cached per environment and not part of a model's start). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def start(model: str, freeze: str, cache_dir: str) -> dict:
    cmd = [sys.executable, "-m", "kvgraph.entrypoints.cli", "generate", "--model", model, "--prompt", "hello",
           "--max-new-tokens", "4", "--json", "--no-progress", "--freeze-weights", freeze]
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    began = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - began
    report = json.loads(out.stdout)
    stats = report["stats"]
    return {
        "wall_s": round(wall, 2),
        "warmup_s": round(report["warmup_s"], 2),
        "inductor_cache_hits": stats.get("inductor_cache_hits"),
        "inductor_cache_misses": stats.get("inductor_cache_misses"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--freeze", default="on,off", help="comma-separated: on, off, auto")
    args = parser.parse_args()
    from kvgraph.ops import cpp

    cpp.build()  # once per environment, not part of a model's start
    results = {}
    for setting in args.freeze.split(","):
        with tempfile.TemporaryDirectory(prefix="kvgraph-startup-") as cache_dir:
            results[f"freeze_{setting}"] = {"first": start(args.model, setting, cache_dir),
                                             "second": start(args.model, setting, cache_dir)}
    print(json.dumps({"model": args.model, "results": results}, indent=2))


if __name__ == "__main__":
    main()
