"""Prometheus metrics of the server, rendered in the text format for ``GET /metrics``.

Engine figures (KV pages, requests running and waiting, prompt and prefix-hit tokens,
preemptions, steps, and steps by the intra-op threads they ran on) are read from ``LLM.stats()``
at scrape time (from the engine process, when the engine runs in one); latencies and generated
tokens are recorded as tokens are handed to the requests. ``kvgraph_engine_pid`` is the process
that runs the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

FINISH_REASONS = ("stop", "length", "abort", "error")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

GAUGES = {
    "kvgraph_kv_pages_used": ("kv_pages_used", "KV cache pages held by sequences (slots for the continuous cache)"),
    "kvgraph_kv_pages_total": ("kv_pages_total", "KV cache pages in the pool (slots for the continuous cache)"),
    "kvgraph_requests_running": ("requests_running", "requests holding KV pages and stepping"),
    "kvgraph_requests_waiting": ("requests_waiting", "requests queued for admission"),
}
COUNTERS = {
    "kvgraph_prompt_tokens": ("prompt_tokens", "prompt tokens admitted"),
    "kvgraph_prefix_hit_tokens": ("prefix_hit_tokens", "prompt tokens served by the prefix cache"),
    "kvgraph_preemptions": ("preemptions", "requests preempted (pages released, context recomputed)"),
    "kvgraph_steps": ("steps", "engine steps run"),
}


class ServeMetrics:
    """The server's own registry: engine gauges and counters, token counts, latency histograms."""

    def __init__(self, stats: Callable[[], dict], engine_pid: int) -> None:
        """``stats``: ``LLM.stats`` or what fetches it; ``engine_pid``: the engine's process."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, engine_pid))
        self.generated_tokens = Counter(
            "kvgraph_generated_tokens", "tokens generated and sent to clients", registry=self.registry
        )
        self.finished = Counter(
            "kvgraph_requests_finished", "requests ended, by finish reason (abort: the client left; error: the engine failed)", ["finish_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # exported from the start, at 0
            self.finished.labels(reason)
        self.ttft = Histogram(
            "kvgraph_time_to_first_token_seconds", "seconds from a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "kvgraph_inter_token_latency_seconds", "seconds between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition (reads ``LLM.stats()``: call it off the event loop)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads ``LLM.stats()`` whenever the registry is collected."""

    def __init__(self, stats: Callable[[], dict], engine_pid: int) -> None:
        self.stats, self.engine_pid = stats, engine_pid

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        yield GaugeMetricFamily("kvgraph_engine_pid", "the process id of the process that runs the engine",
                                value=self.engine_pid)
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        by_threads = CounterMetricFamily(
            "kvgraph_steps_by_threads", "engine steps by the intra-op threads their kernels ran on (CPU)", labels=["threads"])
        for threads, steps in stats["steps_by_threads"].items():
            by_threads.add_metric([str(threads)], steps)
        yield by_threads
