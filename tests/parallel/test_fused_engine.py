"""``LLM(tensor_parallel_size=2)`` over models that fuse Q, K and V into ``c_attn``: the nanoGPT-style
module (paged, prefix caching, preemption) and Hugging Face GPT-2 (continuous cache), on the CPU with
rank 1 spawned and gloo over loopback; greedy tokens equal one process's."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import kvgraph
from tests.nanogpt_model import NanoGPT
from tests.parallel.reference import greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PREFIX = list(range(10, 30))  # 20 shared tokens: 5 full pages of 4, cached after the first request
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [50, 51], [7, 8, 9, 10, 11], PREFIX + [60]]
NEW_TOKENS = 6


def _nanogpt() -> NanoGPT:
    return NanoGPT(vocab=128, n_layer=2, n_embd=32, n_head=4, block_size=64, seed=3)


def _gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, initializer_range=0.2,
                        bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).eval()


@pytest.fixture(autouse=True)
def _bounded_collectives(monkeypatch):
    monkeypatch.setenv("KVGRAPH_TP_TIMEOUT", "120")


def test_nanogpt_paged_with_prefix_caching_and_preemption_equals_one_process():
    # one page: 2 layers x 2 (k, v) x 4 tokens x 4 heads x 8 dims x 4 bytes; 10 pages over both ranks
    llm = kvgraph.LLM(
        _nanogpt(), tensor_parallel_size=2, compile="eager", page_size=4, max_batch_size=4, max_seq_len=40,
        max_batch_tokens=32, kv_cache_memory=10 * 2 * 2 * 4 * 4 * 8 * 4, enable_prefix_caching=True,
        progress=False,
    )
    try:
        sampling = kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        first = llm.generate([PROMPTS[0]], sampling)  # fills the prefix cache
        rest = llm.generate(PROMPTS[1:], sampling)
        stats, heads = llm.stats(), llm.manager.blocks.shape[4]
        fused_rows = llm.model.h[0].attn.c_attn.weight.shape[0]
    finally:
        llm.close()
    model = _nanogpt()
    assert [c.token_ids for c in first + rest] == [greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert rest[0].cached_tokens > 0 and stats["preemptions"] > 0
    assert heads == 2 and fused_rows == 3 * 32 // 2  # rank 0: 2 of the 4 heads, its q, k and v rows


def test_gpt2_continuous_equals_one_process():
    prompts = [[5, 6, 7, 8, 9], [30, 31, 32], [100, 3]]
    llm = kvgraph.LLM(_gpt2(), tensor_parallel_size=2, compile="eager", cache_strategy="continuous",
                      max_batch_size=2, max_seq_len=32, progress=False)
    try:
        done = llm.generate(prompts, kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        c_attn = llm.model.transformer.h[0].attn.c_attn
    finally:
        llm.close()
    assert c_attn.weight.shape == (64, 96) and c_attn.nf == 96  # Conv1D, [in, out]: 48 of q, k, v each
    model = _gpt2()
    assert [c.token_ids for c in done] == [greedy(model, p, NEW_TOKENS) for p in prompts]
