"""``LLM(tensor_parallel_size=2, kv_cache_dtype="int8")`` on the CPU: each rank holds its KV heads
quantized with their scales (a scale group never spans two heads, so the split changes no byte), and
rank 1 repeats rank 0's copy-on-write of pages and scales: greedy tokens equal one process's over
the same int8 cache, under prefix caching and preemption."""

import os

import pytest
import torch

import kvgraph
from kvgraph.engine.loading import model_kv_params
from kvgraph.presets import load_preset

pytestmark = pytest.mark.slow

PREFIX = list(range(10, 30))  # 20 shared tokens: 5 full pages of 4, cached after the first request
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [50, 51], [7, 8, 9, 10, 11], PREFIX + [60], PREFIX[:18]]
# the last matches 4 full pages and 1 row of the 5th, which is copied (copy-on-write)
NEW_TOKENS = 6


def _llm(tensor_parallel_size: int) -> kvgraph.LLM:
    model, _ = load_preset("llama-tiny")
    params = model_kv_params(model, cache_strategy="paged", page_size=4, enable_prefix_caching=True,
                             device=torch.device("cpu"), kv_cache_dtype=torch.int8)
    return kvgraph.LLM(
        model, tensor_parallel_size=tensor_parallel_size, compile="eager", page_size=4, max_batch_size=4,
        max_seq_len=40, max_batch_tokens=32, kv_cache_memory=10 * params.page_bytes, enable_prefix_caching=True,
        kv_cache_dtype="int8", progress=False,
    )


def _generate(llm: kvgraph.LLM) -> tuple[list[list[int]], list]:
    copies = []
    llm.manager.copy_listeners.append(lambda *copy: copies.append(copy))
    sampling = kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([PROMPTS[0]], sampling)  # fills the prefix cache
    rest = llm.generate(PROMPTS[1:], sampling)
    assert copies  # pages (and their scales) were copied on write
    return [c.token_ids for c in first + rest], rest


def test_greedy_tokens_equal_one_process_over_the_int8_cache():
    os.environ.setdefault("KVGRAPH_TP_TIMEOUT", "120")
    one = _llm(1)
    expected, _ = _generate(one)
    one.close()
    llm = _llm(2)
    try:
        got, rest = _generate(llm)
        stats = llm.stats()
        manager = llm.manager
        assert manager.blocks.dtype == torch.int8 and manager.blocks.shape[4] == 1  # 1 of the 2 KV heads
        assert manager.kv_scales.shape[:5] == manager.blocks.shape[:5]
    finally:
        llm.close()
    assert got == expected
    assert rest[0].cached_tokens > 0 and rest[2].cached_tokens > 0
    assert stats["preemptions"] > 0
