"""What the HTTP layer costs: ``kvgraph serve`` under concurrent streaming clients vs the
in-process engine on the same workload.

    python benchmarks/serving.py --model llama-tiny --workload decode-heavy --requests 64 --concurrency 32

First the workload runs through ``kvgraph.LLM`` in this process (compiled and warmed up, one
``generate`` call with all prompts: the engine's own throughput), ``--repeats`` times. Then the same engine settings
run as ``kvgraph serve`` in a subprocess, once per ``--servers`` kind: ``process`` (the default
server: the engine in its own process, the front end at ``--frontend-priority auto``), ``thread``
(``--no-frontend-process``: the engine in a thread of the HTTP server's process), and
``process-normal`` / ``process-idle`` (the engine in its own process, the front end at that priority). ``--concurrency`` asyncio clients send the prompts as
streamed ``/v1/completions`` requests, timing each chunk, ``--repeats`` times. The fastest run of each side counts. Every side runs with
prefix caching off, so no repeat is served by the pages an earlier one cached. Greedy texts must
equal the engine's before any figure is printed. Reports, per server kind, requests/s, tokens/s,
time to first token and inter-token latency percentiles, and ``http_vs_engine`` (server tokens/s ÷
engine tokens/s; the target: >= 0.9 at 32 streams); and ``process_vs_thread``.

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


def engine_run(args, prompts: list[list[int]], max_new_tokens: int) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_preset(args.model)
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
              compile=args.compile, enable_prefix_caching=False)
    llm.warmup()
    elapsed = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        elapsed.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for c in outs)
    return {"texts": [c.text for c in outs], "elapsed_s": min(elapsed), "tokens": tokens}


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
                "process-normal": ["--frontend-priority", "normal"], "process-idle": ["--frontend-priority", "idle"]}


def server_run(args, kind: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """``--repeats`` loads of ``kvgraph serve`` with the engine in a process or a thread (``kind``):
    the fastest run's results, its seconds and the CPU seconds the clients took, and the exit status."""
    flags = ["--model", args.model, "--compile", args.compile, "--max-batch-size", str(args.max_batch_size),
             "--max-seq-len", str(args.max_seq_len), "--no-prefix-caching", *SERVER_FLAGS[kind]]
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--stream-interval", str(args.stream_interval)]
    server = ServerProcess(*flags)
    try:
        url = server.wait_ready()
        log(f"server ({kind}) at {url}: {args.concurrency} concurrent streams")
        runs = []
        for _ in range(args.repeats):
            cpu = time.process_time()
            results, elapsed = run_load(url, args.model, prompts, max_new_tokens, args.concurrency, args.client,
                                        args.client_priority)
            runs.append((results, elapsed, time.process_time() - cpu))
        results, elapsed, client_cpu = min(runs, key=lambda run: run[1])
        exit_status = server.stop()
    finally:
        server.kill()
    return {"results": results, "elapsed_s": elapsed, "client_cpu_s": client_cpu, "exit_status": exit_status}


def server_report(run: dict, engine_texts: list[str], engine_tps: float) -> dict:
    results, elapsed = run["results"], run["elapsed_s"]
    mismatched = sum(r["text"] != t for r, t in zip(results, engine_texts, strict=True))
    if mismatched:
        raise SystemExit(f"{mismatched} of {len(results)} greedy texts differ from the engine's")
    tps = sum(r["tokens"] for r in results) / elapsed
    return {
        "elapsed_s": elapsed, "tokens_per_s": tps, "requests_per_s": len(results) / elapsed,
        "ttft_s": percentiles([r["times"][0] - r["start"] for r in results if r["times"]]),
        "itl_s": percentiles([b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]),
        "exit_status_after_sigterm": run["exit_status"],
        # the load generator shares this host's cores with the server: the CPU seconds it took
        "client_cpu_s": run["client_cpu_s"],
        "greedy_texts_equal": len(results),
        # chunks with text per reply: near max_new_tokens / --stream-interval when every token has
        # text; far fewer means the replies were not streamed token by token
        "chunks_per_reply": statistics.mean(len(r["times"]) for r in results),
        "http_vs_engine": tps / engine_tps,
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
    p.add_argument("--repeats", type=int, default=2, help="runs of each side; the fastest counts")
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
                   "(--frontend-priority normal / idle) (default: process,thread)")
    args = p.parse_args()
    kinds = args.servers.split(",")
    unknown = [k for k in kinds if k not in SERVER_FLAGS]
    if unknown:
        p.error(f"--servers: unknown kind(s) {unknown}; choose from {list(SERVER_FLAGS)}")

    model, _ = load_preset(args.model)
    workload = make_workload(args.workload, num_requests=args.requests, vocab_size=model.config.vocab_size,
                             max_new_tokens=args.max_new_tokens)
    prompts, new = workload.prompts, workload.max_new_tokens
    log(f"engine in process: {len(prompts)} requests x {new} new tokens")
    engine = engine_run(args, prompts, new)
    engine_tps = engine["tokens"] / engine["elapsed_s"]
    servers = {kind: server_report(server_run(args, kind, prompts, new), engine["texts"], engine_tps)
               for kind in kinds}
    report = {
        "model": args.model, "workload": args.workload, "requests": len(prompts), "max_new_tokens": new,
        "concurrency": args.concurrency, "stream_interval": args.stream_interval, "client": args.client,
        "client_priority": args.client_priority, "compile": args.compile, "threads": torch.get_num_threads(),
        "repeats": args.repeats, "load_average": os.getloadavg(),
        "engine": {"elapsed_s": engine["elapsed_s"], "tokens_per_s": engine_tps},
        "servers": servers,
        "target_http_vs_engine_min": 0.9,
    }
    if {"process", "thread"} <= servers.keys():
        report["process_vs_thread"] = servers["process"]["tokens_per_s"] / servers["thread"]["tokens_per_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
