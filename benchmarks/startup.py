"""Start-up to first tokens and to a ready server: a first start (empty Inductor cache) and a second
one (what the first left on disk), for each ``--freeze`` and ``--precompile`` setting, each start a
fresh process.

    python benchmarks/startup.py --model llama-56m --freeze auto --precompile on,off [--cpp-wrapper auto,off,on]

A start of a setting is two processes, each timed from its launch:

- ``kvgraph generate --model M --prompt hello --max-new-tokens 4 --json``: ``wall_s``, the whole
  process including its exit, and the engine's own ``warmup_s``;
- ``kvgraph serve --model M --port 0``: ``ready_s``, until it logs its ready line (the engine
  compiled and warm, the HTTP server listening), which also says how the graphs came to be.

With ``--other-threads N``, ``other_threads`` is a generate and a serve process with ``--threads N``
on what the second start left, and ``default_threads_again`` a generate process after them: a
restart on another thread count (``kvgraph serve``'s engine takes a core fewer than ``generate`` on
a host of more than 2), whose graphs load or are compiled again: the ``warmup_s`` of a load is the
second start's, that of a compile several times it (a compile from Inductor's on-disk cache counts
no hits or misses here, so those do not tell the two apart), and a compile warns that it set the
precompiled file aside.

With ``--serve-first``, ``first_serve`` is a serve process on another empty cache: serve compiles
in the background by default, so ``ready_s`` is its ready line with the lowered graph running
uncompiled, ``compiled_s`` the moment it says the compile worker's graphs load (idle, so no request
waits), and ``second_ready_s`` a later serve process loading what that worker wrote.

Each setting gets its own ``TORCHINDUCTOR_CACHE_DIR`` (fresh, shared by that setting's starts; the
precompiled files live in it too) and, with ``--headers fresh`` (the default), its own temp directory,
where Inductor keeps the C++ headers it precompiles once per user and machine: the first start is a
machine's first. ``--headers kept`` leaves the temp directory as it is (a first start of another
model, or of this one after its cache directory was cleared). ``first`` is a generate process on the empty cache; ``second``
a generate process and then a serve process on what the first left. The C++ kernels
are built before the first timed start (their build is cached per environment and not part of a
model's start). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from kvgraph.entrypoints.serve.launch import ServerProcess


def generate(model: str, flags: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-m", "kvgraph.entrypoints.cli", "generate", "--model", model, "--prompt", "hello",
           "--max-new-tokens", "4", "--json", "--no-progress", *flags]
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


def serve_ready(model: str, flags: list[str], env: dict, until_compiled: float | None = None) -> dict:
    """A serve process: ``ready_s`` until its ready line; with ``until_compiled`` (seconds at most),
    also ``compiled_s`` until it says its compile worker's graphs load."""
    began = time.perf_counter()
    server = ServerProcess("--model", model, *flags, env=env)
    try:
        server.wait_ready()
        result = {"ready_s": round(time.perf_counter() - began, 2),
                  "ready_line": next(line for line in server.log if "ready: serving" in line).strip()}
        while until_compiled is not None and not any("compile worker wrote" in entry for entry in server.log):
            if time.perf_counter() - began > until_compiled or server.proc.poll() is not None:
                raise RuntimeError("no line about the compile worker's graphs:\n" + "".join(server.log[-20:]))
            time.sleep(0.2)
        if until_compiled is not None:
            result["compiled_s"] = round(time.perf_counter() - began, 2)
    finally:
        server.stop()
    return result


def serve_first(model: str, flags: list[str], env: dict) -> dict:
    """A serve process on an empty cache, compiling in the background (serve's default), until its
    compile worker's graphs load; then a second serve process on what that worker wrote."""
    first = serve_ready(model, flags, env, until_compiled=900)
    second = serve_ready(model, flags, env)
    return {**first, "second_ready_s": second["ready_s"], "second_ready_line": second["ready_line"]}


def environment(cache_dir: str, headers: str) -> dict:
    """The starts' environment: Inductor's cache in ``cache_dir``; with ``headers`` "fresh" the temp
    directory too, where Inductor keeps its precompiled C++ headers whatever its cache directory
    (``<temp dir>/torchinductor_<user>/precompiled_headers``, built once per user and machine)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    if headers == "fresh":
        tmp = os.path.join(cache_dir, "tmp")
        os.makedirs(tmp, exist_ok=True)
        env["TMPDIR"] = tmp
    return env


def start(model: str, flags: list[str], env: dict, serve: bool) -> dict:
    return {**generate(model, flags, env), **(serve_ready(model, flags, env) if serve else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--freeze", default="auto", help="comma-separated: on, off, auto")
    parser.add_argument("--precompile", default="on,off", help="comma-separated: on, off")
    parser.add_argument("--cpp-wrapper", default="auto",
                        help="comma-separated: auto (the engine's default: C++ on the CPU), on, off "
                        "(Inductor's C++ or Python wrapper, --cpp-wrapper)")
    parser.add_argument("--other-threads", type=int, metavar="N",
                        help="after the second start, a generate and a serve process with --threads N on the same "
                        "files, then a generate with the default threads again (a restart on another thread count: "
                        "the graphs load, or are compiled again)")
    parser.add_argument("--headers", choices=("fresh", "kept"), default="fresh",
                        help="fresh (the default): each setting's starts get their own temp directory too, so the "
                        "first one also builds Inductor's precompiled C++ headers, as on a machine that never ran "
                        "it; kept: the headers this user's temp directory holds already")
    parser.add_argument("--serve-first", action="store_true",
                        help="also a serve process on an empty cache (compiling in the background) and a "
                        "second one on what its compile worker wrote")
    args = parser.parse_args()
    from kvgraph.ops import cpp

    cpp.build()  # once per environment, not part of a model's start
    results = {}
    settings = [(f, p, c) for f in args.freeze.split(",") for p in args.precompile.split(",")
                for c in args.cpp_wrapper.split(",")]
    for freeze, precompile, cpp_wrapper in settings:
        flags = ["--freeze-weights", freeze, "--precompile" if precompile == "on" else "--no-precompile"]
        name = f"freeze_{freeze}_precompile_{precompile}"
        if cpp_wrapper != "auto":
            flags += ["--cpp-wrapper", cpp_wrapper]
            name += f"_cpp_wrapper_{cpp_wrapper}"
        with tempfile.TemporaryDirectory(prefix="kvgraph-startup-") as cache_dir:
            env = environment(cache_dir, args.headers)
            results[name] = {"first": start(args.model, flags, env, serve=False),
                             "second": start(args.model, flags, env, serve=True)}
            if args.other_threads is not None:
                results[name]["other_threads"] = start(args.model, [*flags, "--threads", str(args.other_threads)],
                                                       env, serve=True)
                results[name]["default_threads_again"] = start(args.model, flags, env, serve=False)
        if args.serve_first:
            with tempfile.TemporaryDirectory(prefix="kvgraph-startup-") as cache_dir:
                results[name]["first_serve"] = serve_first(args.model, flags, environment(cache_dir, args.headers))
    print(json.dumps({"model": args.model, "headers": args.headers, "results": results}, indent=2))


if __name__ == "__main__":
    main()
