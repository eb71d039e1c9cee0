"""What the HTTP layer costs: ``kvgraph serve`` under concurrent streaming clients vs the
in-process engine on the same workload.

    python benchmarks/serving.py --model llama-tiny --workload decode-heavy --requests 64 --concurrency 32

The workload runs through ``kvgraph.LLM`` in this process (compiled and warmed up, one
``generate`` call with all prompts: the engine's own throughput) and through ``kvgraph serve`` in
a subprocess per ``--servers`` kind with the same engine settings: ``process`` (the default
server: the engine in its own process, the front end at ``--frontend-priority auto``), ``thread``
(``--no-frontend-process``: the engine in a thread of the HTTP server's process),
``process-normal`` / ``process-idle`` (the engine in its own process, the front end at that
priority), ``process-fixed`` (``--no-adaptive-threads``: the engine's thread count fixed) and
``process-spin1000`` / ``process-spin300000`` (``GOMP_SPINCOUNT`` in the server's environment:
libgomp's idle threads spin that many times before they sleep; serve's default is 30 000).
``--concurrency`` asyncio clients send the prompts as streamed ``/v1/completions`` requests,
timing each chunk. Every server starts before the first timed run; then each side runs once
untimed (the pool's pages mapped, every graph shape run) and ``--repeats`` rounds follow, each
running every side once (each round starting with the next side), so that the host's drift falls
on every side of a round alike. Every side runs with prefix caching off, so no run is served by the pages an earlier
one cached. Greedy texts must equal the engine's before any figure is printed. Reports, per
server kind, the median round's requests/s, tokens/s, time to first token and inter-token latency
percentiles, and ``http_vs_engine``: the median over rounds of the server's tokens/s ÷ the same
round's engine tokens/s (the target: >= 0.9 at 32 streams; ``http_vs_engine_rounds`` lists each
round's); the CPU seconds the server's front end and its engine process took per run
(``server_cpu_s`` for all of them, ``engine_cpu_s``, from ``/proc``; the in-process engine's
``cpu_s`` beside them) and the engine steps a run took, and the share of the engine's steps run on
each thread count (``steps_by_threads``: the thread governor's choice); and
``process_vs_thread``.

The clients run on the same host as the server and take CPU from it (``client_cpu_s``); on a
2-core host that is a large share. ``--client`` picks them: ``aiohttp`` (the default: the client
vLLM's serving benchmark uses) or ``httpx2`` (the ``openai`` package's). On a 2-core host a
256-request ``llama-tiny`` load took 0.21-0.27 CPU seconds of ``aiohttp`` clients against 0.55-0.83 s
of ``httpx2`` ones, and the server's tokens/s was 1.28x as high (median of 4 alternating runs).
``--client-priority idle`` runs the load generator's thread under Linux's ``SCHED_IDLE``, so that it takes
the host's CPU only when the server leaves some (a model of clients on another host); the default,
``normal``, shares the cores with the server as any process would. ``--threads N`` runs both sides' kernels on ``N`` threads. ``--stream-interval N`` starts the servers
with it (N tokens per chunk; ``itl_s`` is then the time between chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

import aiohttp
import httpx2
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.launch import ServerProcess
from kvgraph.presets import load_preset
from kvgraph.workloads import make_workload, workload_names


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def percentiles(values: list[float]) -> dict:
    if len(values) < 2:
        return {"p50": values[0] if values else None, "p90": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def build_engine(args) -> LLM:
    """The in-process engine with the servers' settings, compiled and warm."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
              compile=args.compile, enable_prefix_caching=False)
    llm.warmup()
    return llm


def engine_run(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One ``generate`` call with every prompt: its texts, seconds, tokens, CPU seconds (this
    process's: the engine's threads) and engine steps."""
    steps, cpu, start = llm.stats()["steps"], time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"texts": [c.text for c in outs], "elapsed_s": elapsed, "tokens": sum(len(c.token_ids) for c in outs),
            "cpu_s": cpu, "steps": llm.stats()["steps"] - steps}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) so far, from ``/proc``;
    ``None`` once it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now, from ``/proc``."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in os.listdir(f"/proc/{pids[i]}/task"):
            try:
                with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                    pids += [int(c) for c in f.read().split()]
            except FileNotFoundError:  # the thread ended meanwhile
                pass
        i += 1
    return pids


def steps_by_threads(server: ServerProcess) -> dict[int, float]:
    """The server's ``kvgraph_steps_by_threads`` counter: intra-op threads -> engine steps so far."""
    out = {}
    for line in server.get("/metrics").splitlines():
        if line.startswith("kvgraph_steps_by_threads_total{"):
            out[int(line.split('threads="')[1].split('"')[0])] = float(line.split()[-1])
    return out


def request_body(model: str, prompt: list[int], max_new_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


class Reply:
    """One streamed reply as it is read: each chunk's arrival, the text, the usage."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.text: list[str] = []
        self.usage: dict | None = None

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[len("data: "):])
        if chunk["choices"]:
            self.times.append(time.perf_counter())
            self.text.append(chunk["choices"][0]["text"])
        self.usage = chunk.get("usage") or self.usage

    def result(self) -> dict:
        return {"start": self.start, "times": self.times, "text": "".join(self.text),
                "tokens": self.usage["completion_tokens"]}


async def httpx2_request(client: httpx2.AsyncClient, url: str, model: str, prompt: list[int],
                         max_new_tokens: int) -> dict:
    reply = Reply()
    async with client.stream("POST", url + "/v1/completions", json=request_body(model, prompt, max_new_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            reply.line(line)
    return reply.result()


async def aiohttp_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                          max_new_tokens: int) -> dict:
    reply = Reply()
    async with session.post(url + "/v1/completions", json=request_body(model, prompt, max_new_tokens)) as response:
        response.raise_for_status()
        async for raw in response.content:  # one line at a time
            reply.line(raw.decode().rstrip("\n"))
    return reply.result()


def client_session(client: str, concurrency: int):
    """The connection pool of ``client``, up to ``concurrency`` connections, and its request function."""
    if client == "aiohttp":
        connector = aiohttp.TCPConnector(limit=concurrency)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)), aiohttp_request
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx2.AsyncClient(timeout=600, limits=limits), httpx2_request


async def load(url: str, model: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int,
               client: str = "aiohttp") -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    session, request = client_session(client, concurrency)
    async with session:

        async def gated(prompt: list[int]) -> dict:
            async with gate:
                return await request(session, url, model, prompt, max_new_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return results, time.perf_counter() - start


def run_load(url: str, model: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int, client: str,
             priority: str) -> tuple[list[dict], float]:
    """:func:`load` in a thread of its own, under ``SCHED_IDLE`` when ``priority`` is ``idle`` (Linux sets a
    scheduling policy per thread, so this process's other threads keep theirs)."""
    outcome: dict = {}

    def body() -> None:
        try:
            if priority == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            outcome["value"] = asyncio.run(load(url, model, prompts, max_new_tokens, concurrency, client))
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=body, name="load-generator")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


SERVER_FLAGS = {"process": [], "thread": ["--no-frontend-process"],
                "process-normal": ["--frontend-priority", "normal"], "process-idle": ["--frontend-priority", "idle"],
                "process-fixed": ["--no-adaptive-threads"], "process-spin1000": [], "process-spin300000": []}
# the server's environment where a kind sets it: libgomp's spin count (serve's default 30 000, libgomp's 300 000)
SERVER_ENV = {"process-spin1000": {"GOMP_SPINCOUNT": "1000"}, "process-spin300000": {"GOMP_SPINCOUNT": "300000"}}


def start_server(args, kind: str) -> ServerProcess:
    """``kvgraph serve`` with the engine settings of ``args`` and the flags of ``kind``, ready."""
    flags = ["--model", args.model, "--compile", args.compile, "--max-batch-size", str(args.max_batch_size),
             "--max-seq-len", str(args.max_seq_len), "--no-prefix-caching", *SERVER_FLAGS[kind]]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--stream-interval", str(args.stream_interval)]
    server = ServerProcess(*flags, env={**os.environ, **SERVER_ENV.get(kind, {})})
    log(f"server ({kind}) at {server.wait_ready()}")
    return server


def server_run(args, server: ServerProcess, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One load of ``server``: its replies, seconds, the CPU seconds the clients, the server's processes
    and its engine process took, and the engine steps run on each thread count."""
    engine_pid = int(server.metric("kvgraph_engine_pid"))
    pids = process_tree(server.proc.pid)
    before_cpu = {pid: cpu_seconds(pid) for pid in pids}
    before_steps = steps_by_threads(server)
    cpu = time.process_time()
    results, elapsed = run_load(server.url, args.model, prompts, max_new_tokens, args.concurrency, args.client,
                                args.client_priority)
    client_cpu = time.process_time() - cpu
    after_cpu = {pid: cpu_seconds(pid) for pid in pids}
    # a process that ended during the load (a compile worker) is left out: its last CPU figure is gone
    spent = {pid: after_cpu[pid] - before_cpu[pid] for pid in pids
             if before_cpu[pid] is not None and after_cpu[pid] is not None}
    steps = {t: n - before_steps.get(t, 0) for t, n in steps_by_threads(server).items()}
    return {"results": results, "elapsed_s": elapsed, "client_cpu_s": client_cpu,
            "server_cpu_s": sum(spent.values()),
            "engine_cpu_s": spent[engine_pid] if engine_pid != server.proc.pid else None,
            "steps_by_threads": {t: n for t, n in sorted(steps.items()) if n},
            "steps": sum(steps.values())}  # every step counts under one thread count


def server_report(runs: list[dict], engine_runs: list[dict], engine_texts: list[str], exit_status: int) -> dict:
    """The figures of one server kind's timed runs, each against the engine run of its round."""
    for run in runs:
        mismatched = sum(r["text"] != t for r, t in zip(run["results"], engine_texts, strict=True))
        if mismatched:
            raise SystemExit(f"{mismatched} of {len(run['results'])} greedy texts differ from the engine's")
    tps = [sum(r["tokens"] for r in run["results"]) / run["elapsed_s"] for run in runs]
    ratios = [t / (e["tokens"] / e["elapsed_s"]) for t, e in zip(tps, engine_runs, strict=True)]
    median_run = sorted(range(len(runs)), key=lambda i: runs[i]["elapsed_s"])[len(runs) // 2]
    run, results = runs[median_run], runs[median_run]["results"]
    steps: dict[int, float] = {}
    for r in runs:
        for threads, n in r["steps_by_threads"].items():
            steps[threads] = steps.get(threads, 0) + n
    return {
        "elapsed_s": run["elapsed_s"], "tokens_per_s": tps[median_run], "requests_per_s": len(results) / run["elapsed_s"],
        "ttft_s": percentiles([r["times"][0] - r["start"] for r in results if r["times"]]),
        "itl_s": percentiles([b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]),
        "exit_status_after_sigterm": exit_status,
        # the load generator shares this host's cores with the server: the CPU seconds it took
        "client_cpu_s": run["client_cpu_s"],
        # the server's processes (front end and engine) and its engine process alone (None: a thread)
        "server_cpu_s": run["server_cpu_s"], "engine_cpu_s": run["engine_cpu_s"], "engine_steps": run["steps"],
        # share of the timed runs' engine steps on each intra-op thread count (the governor's choice)
        "steps_by_threads": {t: round(n / sum(steps.values()), 3) for t, n in sorted(steps.items())},
        "greedy_texts_equal": len(results),
        # chunks with text per reply: near max_new_tokens / --stream-interval when every token has
        # text; far fewer means the replies were not streamed token by token
        "chunks_per_reply": statistics.mean(len(r["times"]) for r in results),
        "http_vs_engine": statistics.median(ratios),
        "http_vs_engine_rounds": [round(r, 3) for r in ratios],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--workload", choices=workload_names(), default="decode-heavy")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, help="override the workload's output length")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--compile", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds, each running every side once; medians count (default 3)")
    p.add_argument("--threads", type=int, help="torch threads of every side (default: one per core)")
    p.add_argument("--client", choices=("aiohttp", "httpx2"), default="aiohttp",
                   help="the load generator's HTTP client (default: aiohttp, the leaner on CPU)")
    p.add_argument("--client-priority", choices=("normal", "idle"), default="normal",
                   help="the load generator's scheduling: normal, or idle (SCHED_IDLE: CPU only when the "
                   "server leaves some, as clients on another host) (default: normal)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the servers' --stream-interval: tokens per streamed chunk (default 1)")
    p.add_argument("--servers", default="process,thread",
                   help="server kinds to measure, comma-separated: process (the engine in its own process, "
                   "the default server), thread (--no-frontend-process), process-normal and process-idle "
                   "(--frontend-priority normal / idle), process-fixed (--no-adaptive-threads), "
                   "process-spin1000 and process-spin300000 (GOMP_SPINCOUNT=N) (default: process,thread)")
    args = p.parse_args()
    kinds = args.servers.split(",")
    unknown = [k for k in kinds if k not in SERVER_FLAGS]
    if unknown:
        p.error(f"--servers: unknown kind(s) {unknown}; choose from {list(SERVER_FLAGS)}")

    model, _ = load_preset(args.model)
    workload = make_workload(args.workload, num_requests=args.requests, vocab_size=model.config.vocab_size,
                             max_new_tokens=args.max_new_tokens)
    prompts, new = workload.prompts, workload.max_new_tokens
    log(f"{len(prompts)} requests x {new} new tokens, {args.concurrency} concurrent streams")
    llm = build_engine(args)
    servers = {kind: start_server(args, kind) for kind in kinds}
    try:
        engine_texts = engine_run(llm, prompts, new)["texts"]  # untimed: every side's pages mapped, shapes run
        for server in servers.values():
            server_run(args, server, prompts, new)
        engine_runs, server_runs = [], {kind: [] for kind in kinds}
        sides = ["engine", *kinds]
        for round_ in range(args.repeats):
            # each round starts with another side: what a run leaves behind (a busy page cache, a
            # hot or cold core) falls on every side in turn
            for side in sides[round_ % len(sides):] + sides[:round_ % len(sides)]:
                if side == "engine":
                    engine_runs.append(engine_run(llm, prompts, new))
                else:
                    server_runs[side].append(server_run(args, servers[side], prompts, new))
            log(f"round {round_ + 1}: engine {engine_runs[-1]['elapsed_s']:.2f} s, "
                + ", ".join(f"{k} {r[-1]['elapsed_s']:.2f} s" for k, r in server_runs.items()))
        exit_status = {kind: server.stop() for kind, server in servers.items()}
    finally:
        for server in servers.values():
            server.kill()
    if any(run["texts"] != engine_texts for run in engine_runs):
        raise SystemExit("the engine's greedy texts changed between runs")
    engine_tps = [r["tokens"] / r["elapsed_s"] for r in engine_runs]
    reports = {kind: server_report(server_runs[kind], engine_runs, engine_texts, exit_status[kind]) for kind in kinds}
    report = {
        "model": args.model, "workload": args.workload, "requests": len(prompts), "max_new_tokens": new,
        "concurrency": args.concurrency, "stream_interval": args.stream_interval, "client": args.client,
        "client_priority": args.client_priority, "compile": args.compile, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "load_average": os.getloadavg(),
        "engine": {"tokens_per_s": statistics.median(engine_tps), "tokens_per_s_rounds": [round(t, 1) for t in engine_tps],
                   "cpu_s": statistics.median(r["cpu_s"] for r in engine_runs),
                   "steps": statistics.median(r["steps"] for r in engine_runs)},
        "servers": reports,
        "target_http_vs_engine_min": 0.9,
    }
    if {"process", "thread"} <= reports.keys():
        report["process_vs_thread"] = reports["process"]["tokens_per_s"] / reports["thread"]["tokens_per_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
