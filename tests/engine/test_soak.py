"""Soak: many requests arriving over time, random aborts, a page pool small enough to preempt.

Every request that is not aborted must produce the model's own greedy tokens (its run without
any other request), and at the end every page is free and every slot released. CI runs 100
requests; ``KVGRAPH_SOAK_REQUESTS=1000`` (``make soak``) runs more.
"""

import os
import random

import pytest
import torch

from kvgraph.cache.params import KVCacheParams
from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM

REQUESTS = int(os.environ.get("KVGRAPH_SOAK_REQUESTS", "100"))
PAGE = 4
POOL_PAGES = 12  # 48 tokens: a request alone fits (at most 27 cached tokens), eight at once do not
MAX_BATCH = 8


@pytest.fixture(scope="module")
def engine(llama):
    model, tokenizer = llama
    c = model.config
    page_bytes = KVCacheParams(torch.float32, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                               c.num_hidden_layers, page_size=PAGE).page_bytes
    return LLM(model, tokenizer=tokenizer, page_size=PAGE, max_batch_size=MAX_BATCH, max_seq_len=32,
               max_batch_tokens=16, kv_cache_memory=POOL_PAGES * page_bytes, compile="eager")


def workload(rng: random.Random) -> list[tuple[list[int], int]]:
    """``(prompt, max_new_tokens)`` per request; some prompts share a prefix (prefix-cache hits)."""
    shared = [rng.randrange(3, 259) for _ in range(8)]
    out = []
    for _ in range(REQUESTS):
        n = rng.randint(1, 20)
        prompt = (shared[: rng.randint(1, 8)] if rng.random() < 0.3 else [])
        prompt = (prompt + [rng.randrange(3, 259) for _ in range(n)])[:20]
        out.append((prompt, rng.randint(1, 8)))
    return out


def test_soak_with_random_aborts_and_preemption_matches_greedy_and_leaks_nothing(engine, llama, hf_greedy):
    model, _ = llama
    rng = random.Random(0)
    pending = workload(rng)
    requests: dict[int, tuple[list[int], int]] = {}
    aborted: set[int] = set()
    engine.reset_stats()
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, n = pending.pop()
                rid = engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
                requests[rid] = (prompt, n)
        live = [rid for rid in requests if rid not in aborted and engine.completion(rid).finish_reason is None]
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        engine.step(detokenize=False)
    stats = engine.stats()
    assert len(requests) == REQUESTS and stats["preemptions"] > 0 and aborted
    for rid, (prompt, n) in requests.items():
        out = engine.completion(rid)
        if rid in aborted:
            assert out.finish_reason == "abort"
            continue
        assert out.finish_reason == "length", (rid, out)
        assert out.token_ids == hf_greedy(model, prompt, n), (rid, prompt)
    m = engine.manager
    assert m.free_pages == m.total_pages and m.num_claimed == 0
    assert not engine.has_unfinished() and not engine.scheduler.running and not engine.scheduler.waiting
