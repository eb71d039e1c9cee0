"""``kvgraph serve``: compile and warm up the model, then serve it over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time

from kvgraph.entrypoints.cli.common import (
    add_engine_args,
    add_model_args,
    build_llm,
    engine_config,
    non_negative_float,
    positive_int,
)
from kvgraph.entrypoints.cli.heap import freeze_warm_heap
from kvgraph.errors import require_extra

FRONTEND_PRIORITIES = ("auto", "normal", "idle")
"""``--frontend-priority``'s choices (``kvgraph.entrypoints.serve.priority.PRIORITIES``, not imported
here: that package imports FastAPI, which every other command would then load, or fail on)."""


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "All requests batch together in one engine. The model is compiled and warmed up before the "
        "server listens; SIGTERM or Ctrl-C stops it cleanly.",
    )
    add_model_args(p)
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    h.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0: any free port)")
    h.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    h.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                   help="seconds in-flight requests may take to finish on shutdown before they are "
                   "aborted (default 30)")
    h.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="tokens of a streamed request sent together in one chunk (default 1: each token "
                   "as it comes). The first token and the last go at once. A larger N costs the HTTP "
                   "layer and the clients less CPU per token, for burstier streams (as vLLM's option)")
    h.add_argument("--no-frontend-process", dest="frontend_process", action="store_false",
                   help="run the engine in a thread of the HTTP server's process (default: the engine "
                   "runs in its own process, so the HTTP layer never takes its GIL)")
    h.add_argument("--frontend-priority", choices=FRONTEND_PRIORITIES, default="auto",
                   help="CPU priority of the HTTP front end's process. idle (Linux's SCHED_IDLE) runs it "
                   "only when a core has nothing else to do, so it never holds up the engine's kernel "
                   "threads: more tokens/s, for later chunks (a longer tail of inter-token latency). "
                   "auto (default): idle when the engine's threads take every core, back to normal "
                   "for good if another process keeps the cores busy; else normal")
    add_engine_args(p)
    p.set_defaults(run=run, background_compile=True)  # a server answers at once on a first start


def run(args: argparse.Namespace) -> int:
    require_extra("serve", "kvgraph serve", "fastapi", "uvicorn", "prometheus_client")
    from kvgraph.entrypoints.serve import priority
    from kvgraph.entrypoints.serve.async_engine import AsyncEngine
    from kvgraph.entrypoints.serve.engine_client import EngineClient
    from kvgraph.entrypoints.serve.server import serve

    priority.check(args.frontend_priority, args.frontend_process)
    _configure_logging()
    log = logging.getLogger("kvgraph.serve")
    start = time.perf_counter()
    guard = None
    if args.frontend_process:
        engine_config(args, progress=True)  # the flags, checked before the engine process starts
        if args.threads is None and args.tensor_parallel_size == 1:
            args.threads = engine_threads()
        cores = usable_cores()
        level = priority.resolve(args.frontend_priority, (args.threads or cores) * args.tensor_parallel_size, cores)
        engine = EngineClient.launch(functools.partial(warm_llm, args), args.stream_interval)
        freeze_warm_heap()  # the front end's: warm_llm froze the engine process's
        # after the engine process started, which keeps the normal priority
        guarded = level == "idle" and args.frontend_priority == "auto"
        if guarded:
            guard = priority.StarvationGuard()  # back to normal if another process starves it
            guard.start()
        else:
            priority.apply(level)
        shown = "idle (normal if starved)" if guarded else level
        note = f"{engine.startup_note}; engine process {engine.pid}; front end at {shown} priority"
    else:
        llm = warm_llm(args)
        engine, note = AsyncEngine(llm, args.stream_interval), llm.startup_note()
    startup = f"started in {time.perf_counter() - start:.1f}s: {note}"
    log.info("compiled and warm, %s", startup)
    return serve(engine, args.served_model_name or args.model, args.host, args.port, args.shutdown_timeout, startup,
                 guard)


def engine_threads() -> int:
    """The engine process's kernel threads without ``--threads``: one per core, but one core left
    to the HTTP front end on a host of more than 2 (as vLLM's CPU backend reserves one). An OpenMP
    region ends with its slowest thread, so a kernel thread sharing its core with a busy front end
    stalls every layer; on 2 cores, though, halving the engine cost more on ``llama-56m`` (0.61 of
    the in-process engine on 1 thread, 0.86 on 2: ``benchmarks/serving.py``)."""
    cores = usable_cores()
    return cores - 1 if cores > 2 else cores


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def warm_llm(args: argparse.Namespace):
    """The ``LLM`` of ``args``, compiled and warmed up (in the engine process, by default)."""
    _configure_logging()
    llm = build_llm(args)
    logging.getLogger("kvgraph.serve").info("compiling and warming up %s", args.model)
    llm.warmup()
    freeze_warm_heap()
    return llm


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
