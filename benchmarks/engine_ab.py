"""Engine settings side by side in one process, runs alternating: frozen weights or not, linear
layers packed by kvgraph or left to Inductor, and Dynamo guard evaluation skipped between steps or not.

    python benchmarks/engine_ab.py --model llama-56m --workloads mixed,decode-heavy --repeats 3

Engines: ``frozen`` (``freeze_weights=True``; guards skipped after each shape class's first
call, as in all of them), ``unfrozen`` (``freeze_weights=False``), ``inductor_linears`` (frozen,
with ``packed_linears=False``: Inductor's oneDNN linears instead of ``kvgraph::linear``),
``default`` (the default settings), ``python_linears`` (the defaults, with the graphs calling
``kvgraph::linear``'s Python implementation, which calls ``kvgraph_cpu::packed_linear``, instead of
``kvgraph_cpu::packed_linear`` itself), ``mkl_linears`` (as ``python_linears``, with the Python
implementation's own MKL pack in place of kvgraph's C++ library: its panel GEMM against MKL's packed
GEMM, each behind the op's Python implementation; the MKL path's own per-call checks ride along),
``onednn_linears`` (the defaults on a model of its own, its weights packed for oneDNN's product:
``KVGRAPH_PACKED_GEMM=onednn`` while it warms up, where each weight is packed),
``no_huge_pages`` (the defaults on a model of its own, built and warmed up with
``KVGRAPH_HUGE_PAGES=0``: its weights packed and its cache pool allocated without the huge-page
advice and the packs' arena), ``with_asserts`` (the defaults, compiled with Inductor's size and alignment asserts),
``wrapper_with_kernels`` (the defaults, a C++ wrapper built with its kernels in one -O3 compile
instead of apart at -O1; traced like ``with_asserts``: compare it with ``traced``), ``cpp_wrapper`` / ``python_wrapper`` (the defaults, with
Inductor's C++ or Python wrapper around the graph's kernels), ``traced``
(the defaults without ``precompile``: each call through Dynamo's frame evaluation and guards rather
than the precompiled graph's captured bytecode), and
``all_guards`` (frozen, every guard evaluated at every call: ``ModelRunner.skip_guards = False``;
it shares the ``frozen`` engine's
compiled graphs, so it is the same engine with the runner's flag flipped). Each engine is compiled
and warmed up before timing (the compiled graphs are warm-up) and runs each workload once untimed
(the GEMM kernels oneDNN builds per new shape are warm-up too); every timed run starts from an
empty prefix cache (``kvgraph.entrypoints.cli.bench.run_kvgraph``). Within a repeat the variants
take turns, in a rotated order per repeat. Prints medians, each run, the ratios to the first
variant named, and whether the greedy outputs agree with its.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from unittest import mock

import torch

from kvgraph.compiler import backend
from kvgraph.engine import sampling
from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.llm import LLM
from kvgraph.ops import cpp, linear
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload

NEW_TOKENS = {"mixed": None, "decode-heavy": 128}
ENGINES = {  # engine name -> LLM settings; the all_guards variant runs the frozen engine
    "frozen": {"freeze_weights": True},
    "unfrozen": {"freeze_weights": False},
    "inductor_linears": {"freeze_weights": True, "packed_linears": False},
    "default": {},
    # The next two patch the compile: traced, so that they do not load the default's precompiled graphs.
    "python_linears": {"precompile": False},  # kvgraph::linear's Python implementation in the graph
    "mkl_linears": {"precompile": False},  # the same, multiplying with MKL's pack instead of kvgraph's C++ GEMM
    "onednn_linears": {},  # the defaults, weights packed for oneDNN's product (a model of its own)
    "no_huge_pages": {},  # the defaults, packs and cache pool in plain 4 KB pages (a model of its own)
    "with_asserts": {"precompile": False},  # compiled with Inductor's size and alignment asserts
    "wrapper_with_kernels": {"precompile": False},  # the C++ wrapper and its kernels in one -O3 build
    "traced": {"precompile": False},  # the defaults, called through Dynamo instead of precompiled
    "torch_greedy": {},  # the defaults, greedy tokens picked by torch.max instead of kvgraph's argmax_rows
    "cpp_wrapper": {"cpp_wrapper": True},  # the defaults, with Inductor's C++ wrapper calling the kernels
    "python_wrapper": {"cpp_wrapper": False},  # the defaults, with Inductor's Python wrapper
}


@contextlib.contextmanager
def compiled_as(name: str):
    """While ``name``'s engine compiles: ``python_linears`` and ``mkl_linears`` keep their graphs off
    ``kvgraph_cpu::packed_linear``, ``with_asserts`` turns Inductor's size and alignment asserts back on,
    ``wrapper_with_kernels`` builds a C++ wrapper and its kernels as one file at -O3 again."""
    if name in ("python_linears", "mkl_linears"):
        saved, cached = cpp.packed_linear_kernel, linear._cpp_linear
        cpp.packed_linear_kernel = lambda: None
        try:
            yield
        finally:
            cpp.packed_linear_kernel, linear._cpp_linear = saved, cached
    elif name == "onednn_linears":
        with mock.patch.dict(os.environ, {"KVGRAPH_PACKED_GEMM": "onednn"}):
            yield
    elif name in ("with_asserts", "wrapper_with_kernels"):
        saved = backend._inductor_config
        changes = ({"size_asserts": True, "alignment_asserts": True} if name == "with_asserts"
                   else {"cpp_wrapper_build_separate": False})

        def with_changes(options, device):
            stack = contextlib.ExitStack()
            stack.enter_context(saved(options, device))
            stack.enter_context(torch._inductor.config.patch(changes))
            return stack

        backend._inductor_config = with_changes
        try:
            yield
        finally:
            backend._inductor_config = saved
    else:
        yield


@contextlib.contextmanager
def built_as(name: str):
    """While ``name``'s engine is built and warmed up: ``no_huge_pages`` with ``KVGRAPH_HUGE_PAGES=0``
    (its cache pool is allocated when it is built, its weights packed when it warms up)."""
    if name == "no_huge_pages":
        with mock.patch.dict(os.environ, {"KVGRAPH_HUGE_PAGES": "0"}):
            yield
    else:
        yield


@contextlib.contextmanager
def running_as(name: str):
    """While ``name``'s engine runs: ``mkl_linears``' ``kvgraph::linear`` multiplies with MKL's pack
    (its Python path without kvgraph's C++ library), ``python_linears``' with kvgraph's C++ kernel;
    ``torch_greedy`` picks greedy tokens with ``torch.max``."""
    if name == "torch_greedy":
        sampling.greedy_tokens(torch.zeros(1, 1))  # looks the C++ op up
        saved_greedy = sampling._argmax_rows[:]
        sampling._argmax_rows[:] = [None]
        try:
            yield
        finally:
            sampling._argmax_rows[:] = saved_greedy
        return
    if name not in ("python_linears", "mkl_linears"):
        yield
        return
    saved = linear._cpp_linear
    linear._cpp_linear = None if name == "mkl_linears" else cpp.packed_linear_kernel()
    try:
        yield
    finally:
        linear._cpp_linear = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--workloads", default="mixed,decode-heavy")
    parser.add_argument("--requests", type=int, default=64, help="mixed (decode-heavy uses half)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="frozen,unfrozen,all_guards")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="cast the model (default: as built)")
    args = parser.parse_args()

    model, tokenizer = load_preset(args.model)
    variants = args.variants.split(",")
    engines = {}
    started = {}
    for name, settings in ENGINES.items():
        if name in variants or (name == "frozen" and "all_guards" in variants):
            t = time.perf_counter()
            # packs are kept per weight tensor: an engine packing for another product needs its own
            own = load_preset(args.model)[0] if name in ("onednn_linears", "no_huge_pages") else model
            with built_as(name):
                engines[name] = LLM(own, tokenizer=tokenizer, max_batch_size=64, max_seq_len=1024, progress=False,
                                    dtype=None if args.dtype is None else getattr(torch, args.dtype), **settings)
                with running_as(name), compiled_as(name):
                    engines[name].warmup()
            started[name] = round(time.perf_counter() - t, 1)
    report = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "startup_s": started, "workloads": {}}
    for workload_name in args.workloads.split(","):
        n = args.requests if workload_name == "mixed" else args.requests // 2
        workload = make_workload(workload_name, num_requests=n, vocab_size=next(iter(engines.values())).vocab_size,
                                 max_new_tokens=NEW_TOKENS.get(workload_name))
        first_runs = {}
        for name, llm in engines.items():  # warm-up: oneDNN builds a kernel per new GEMM shape on first sight
            with running_as(name):
                first_runs[name] = round(run_kvgraph(llm, workload)[0].elapsed_s, 3)
        times = {v: [] for v in variants}
        outputs = {}
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants):] + variants[: repeat % len(variants)]
            for variant in order:
                llm = engines["frozen" if variant == "all_guards" else variant]
                llm.runner.skip_guards = variant != "all_guards"
                with running_as(variant):
                    result, _ = run_kvgraph(llm, workload)
                llm.runner.skip_guards = True
                times[variant].append(result.elapsed_s)
                outputs[variant] = result.outputs
                print(f"[{time.strftime('%H:%M:%S')}] {workload_name} #{repeat} {variant}: {result.elapsed_s:.3f} s",
                      file=sys.stderr, flush=True)
        base = statistics.median(times[variants[0]])
        report["workloads"][workload_name] = {
            v: {
                "median_s": round(statistics.median(t), 3), "runs_s": [round(x, 3) for x in t],
                f"time_vs_{variants[0]}": round(statistics.median(t) / base, 3),
                f"outputs_equal_{variants[0]}": outputs[v] == outputs[variants[0]],
            }
            for v, t in times.items()
        }
        report["workloads"][workload_name]["first_run_s"] = first_runs
    report["recompiles"] = {name: llm.stats()["recompiles"] for name, llm in engines.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
