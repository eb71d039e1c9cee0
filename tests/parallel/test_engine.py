"""``LLM(tensor_parallel_size=2)`` on the CPU: rank 0 here, rank 1 spawned, gloo over loopback.

One engine serves the module: greedy tokens equal one process's under prefix caching and
preemption; then rank 1 is killed, which must give a clear error naming it, not a hang, and
closing leaves no process behind.
"""

import os
import signal

import pytest
import torch

import kvgraph
from kvgraph.errors import RankFailedError
from kvgraph.presets import load_preset
from tests.naming import raises_naming
from tests.parallel.reference import greedy

pytestmark = pytest.mark.slow

PREFIX = list(range(10, 30))  # 20 shared tokens: 5 full pages of 4, cached after the first request
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [50, 51], [7, 8, 9, 10, 11], PREFIX + [60]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engine():
    os.environ.setdefault("KVGRAPH_TP_TIMEOUT", "120")
    model, _ = load_preset("llama-tiny")
    llm = kvgraph.LLM(
        model, tensor_parallel_size=2, compile="eager", page_size=4, max_batch_size=4, max_seq_len=40,
        max_batch_tokens=32, kv_cache_memory=10 * _page_bytes(model), enable_prefix_caching=True,
    )
    yield llm
    llm.close()
    assert [p.exitcode for p in llm.strategy.group.workers] in ([0], [-signal.SIGKILL])


def _page_bytes(model) -> int:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * 4  # fp32, page_size 4


def test_greedy_tokens_equal_one_process_with_prefix_caching_and_preemption(engine):
    model, _ = load_preset("llama-tiny")
    sampling = kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine.generate([PROMPTS[0]], sampling)  # fills the prefix cache
    rest = engine.generate(PROMPTS[1:], sampling)
    got = [c.token_ids for c in first + rest]
    assert got == [greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    stats = engine.stats()
    assert rest[0].cached_tokens > 0 and rest[2].cached_tokens > 0
    assert stats["preemptions"] > 0  # 10 pages cannot hold the three running sequences at once
    assert engine.manager.blocks.shape[4] == 1  # rank 0 holds 1 of the 2 KV heads


def test_prompt_scores_equal_the_models_log_softmax_with_every_rank_taking_the_positions(engine):
    """A scoring request beside a plain one: rank 1 receives the step's logit positions too."""
    model, _ = load_preset("llama-tiny")
    sampling = [kvgraph.SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=1),
                kvgraph.SamplingParams(max_new_tokens=2, ignore_eos=True)]
    scored, plain = engine.generate([PROMPTS[0], PROMPTS[2]], sampling)
    with torch.no_grad():
        expected = torch.log_softmax(model(input_ids=torch.tensor([PROMPTS[0]])).logits[0].double(), -1)
    assert scored.prompt_logprobs[0] is None and plain.prompt_logprobs is None
    for i, entry in enumerate(scored.prompt_logprobs[1:], start=1):
        assert entry.logprob == pytest.approx(float(expected[i - 1, PROMPTS[0][i]]), abs=1e-4)
    assert plain.token_ids == greedy(model, PROMPTS[2], 2)


def test_a_killed_rank_is_named_and_does_not_hang(engine):
    (worker,) = engine.strategy.group.workers
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=30)
    sampling = kvgraph.SamplingParams(max_new_tokens=2, ignore_eos=True)
    with raises_naming(RankFailedError, "rank 1", f"(pid {worker.pid})", "SIGKILL"):

        engine.generate([[3, 4, 5]], sampling)
    with pytest.raises(RankFailedError, match="rank 1"):  # the group stays down
        engine.generate([[3, 4, 5]], sampling)
