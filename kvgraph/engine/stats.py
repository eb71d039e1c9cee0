"""Engine counters: throughput, batch sizes, KV pages, prefix hits, preemptions, recompiles."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgraph.cache.managers.base import KVCacheManager
from kvgraph.cache.managers.paged import PagedKVCacheManager
from kvgraph.engine.requests import EngineRequest


@dataclass
class EngineStats:
    """Running totals the engine updates after every step; ``LLM.stats()`` snapshots them.

    A step that mixes prefill chunks and decodes splits its wall time between the two
    in proportion to their token counts, so ``prefill_tokens_per_s`` and
    ``decode_tokens_per_s`` each divide tokens by the time spent on them. Steps that
    compiled a graph count their tokens but not in the rates: their time goes to
    ``compile_time_s``.
    """

    steps: int = 0
    model_calls: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    timed_prefill_tokens: int = 0  # of steps that compiled nothing: what the rates divide
    timed_decode_tokens: int = 0
    compile_steps: int = 0
    compile_time_s: float = 0.0
    batch_sizes: Counter = field(default_factory=Counter)
    steps_by_threads: Counter = field(default_factory=Counter)  # intra-op threads -> steps run on them
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # requests whose step raised in the model (finish_reason "error")
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_peak: int = 0
    kv_page_bytes: int = 0
    kv_unit: str = "page"  # what the kv_pages_* figures count: "page" (paged) or "slot" (continuous)
    kv_unit_tokens: int = 0  # tokens one unit holds: page_size, or max_seq_len for a slot
    kv_slots_held: int = 0  # summed over steps: token slots of the pages sequences hold
    kv_tokens_stored: int = 0  # summed over steps: tokens those slots hold
    compiled_graphs: int = 0
    warmup_graphs: int = 0
    recompiles: int = 0

    def record_step(
        self, batch_size: int, prefill_tokens: int, decode_tokens: int, seconds: float, model_calls: int = 1,
        compiled: bool = False, threads: int | None = None,
    ) -> None:
        """One scheduled batch of ``batch_size`` sequences (``model_calls`` model runs when multistep);
        ``compiled``: one of its model calls compiled a graph, so its time is not a serving rate;
        ``threads``: the intra-op threads it ran on, where the engine knows them."""
        self.steps += 1
        if threads is not None:
            self.steps_by_threads[threads] += 1
        self.model_calls += model_calls
        self.batch_sizes[batch_size] += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        if compiled:
            self.compile_steps += 1
            self.compile_time_s += seconds
            return
        self.timed_prefill_tokens += prefill_tokens
        self.timed_decode_tokens += decode_tokens
        total = prefill_tokens + decode_tokens
        if total:
            self.prefill_time_s += seconds * prefill_tokens / total
            self.decode_time_s += seconds * decode_tokens / total

    def record_pages(self, used: int, total: int, page_bytes: int, unit: str, unit_tokens: int) -> None:
        """Pages (slots, for the continuous cache) held by sequences now, of ``total``."""
        self.kv_pages_total = total
        self.kv_pages_used = used
        self.kv_pages_peak = max(self.kv_pages_peak, used)
        self.kv_page_bytes = page_bytes
        self.kv_unit, self.kv_unit_tokens = unit, unit_tokens

    def record_occupancy(self, slots_held: int, tokens_stored: int) -> None:
        """After a step: token slots of the held pages, and how many of them hold a token."""
        self.kv_slots_held += slots_held
        self.kv_tokens_stored += tokens_stored

    @property
    def kv_waste(self) -> float:
        """Fraction of the token room of held pages (continuous: of held slots, ``max_seq_len`` each)
        that held no token, averaged over steps: page slack and lookahead, or a slot's unused length."""
        return 1.0 - self.kv_tokens_stored / self.kv_slots_held if self.kv_slots_held else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens served by the prefix cache."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "model_calls": self.model_calls,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "prefill_tokens_per_s": _rate(self.timed_prefill_tokens, self.prefill_time_s),
            "decode_tokens_per_s": _rate(self.timed_decode_tokens, self.decode_time_s),
            "prefill_time_s": self.prefill_time_s,
            "decode_time_s": self.decode_time_s,
            "compile_steps": self.compile_steps,
            "compile_time_s": self.compile_time_s,
            "batch_size_histogram": dict(sorted(self.batch_sizes.items())),
            "steps_by_threads": dict(sorted(self.steps_by_threads.items())),
            "kv_pages_used": self.kv_pages_used,
            "kv_pages_free": self.kv_pages_total - self.kv_pages_used,
            "kv_pages_peak": self.kv_pages_peak,
            "kv_pages_total": self.kv_pages_total,
            "kv_unit": self.kv_unit,
            "kv_unit_tokens": self.kv_unit_tokens,
            "kv_peak_bytes": self.kv_pages_peak * self.kv_page_bytes,
            "kv_allocated_bytes": self.kv_pages_total * self.kv_page_bytes,
            "kv_waste": self.kv_waste,
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_rate,
            "preemptions": self.preemptions,
            "finished": self.finished,
            "aborted": self.aborted,
            "failed": self.failed,
            "compiled_graphs": self.compiled_graphs,
            "warmup_graphs": self.warmup_graphs,
            "recompiles": self.recompiles,
        }


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def cache_usage(manager: KVCacheManager) -> tuple[int, int, int, str, int]:
    """``(held, total, bytes each, unit, tokens each)`` of the cache's units: pages of a paged pool,
    slots of a continuous cache (each reserves ``max_seq_len`` tokens)."""
    params = manager.params
    if isinstance(manager, PagedKVCacheManager):
        held = manager.total_pages - manager.free_pages
        return held, manager.total_pages, params.page_bytes, "page", manager.page_size
    slot_bytes = manager.max_seq_len * params.bytes_per_token
    return manager.num_claimed, manager.max_batch_size, slot_bytes, "slot", manager.max_seq_len


def kv_usage_text(stats: dict) -> str:
    """The KV figures of ``LLM.stats()`` in words, in the cache's own unit: pages, or slots
    whose reserved room the waste figure measures."""
    text = (f"peak {stats['kv_pages_peak']} of {stats['kv_pages_total']} KV {stats['kv_unit']}s "
            f"({stats['kv_unit_tokens']} tokens each")
    if stats["kv_unit"] == "slot":
        return text + f", reserved whole: {stats['kv_waste']:.0%} of the held slots' room unused)"
    return text + f", {stats['kv_waste']:.0%} of the held pages' room unused)"


def occupancy(manager: KVCacheManager, running: Sequence[EngineRequest]) -> tuple[int, int]:
    """``(slots held, tokens stored)`` by the running sequences, each counting its own pages (a
    shared prefix page is full, so sharing adds no slack)."""
    if isinstance(manager, PagedKVCacheManager):
        held = sum(len(manager.pages_of(r.seq_id)) for r in running) * manager.page_size
    else:
        held = len(running) * manager.max_seq_len
    return held, sum(r.num_computed for r in running)
