"""Prompt log-probabilities: a request's own prompt tokens scored by the graph that serves every step."""

import pytest
import torch

from kvgraph import LLM, SamplingParams
from kvgraph.engine.prompt_logprobs import PromptLogprob, record
from kvgraph.errors import ConfigError
from tests.naming import raises_naming


def _eager_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """``[P, V]`` log-softmax of the model's own logits at every prompt position (no cache)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check_scores(scores: list, prompt: list[int], expected: torch.Tensor, top_k: int) -> None:
    assert len(scores) == len(prompt) and scores[0] is None
    for i, entry in enumerate(scores[1:], start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)
        assert len(entry.top) == top_k
        ids = [t for t, _ in entry.top]
        assert ids == expected[i - 1].topk(top_k).indices.tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)


@pytest.fixture(scope="module")
def engine(llama):
    """Inductor-compiled: the rows of a step are a symbolic size of the one graph, so scoring a
    prompt compiles nothing more."""
    model, tokenizer = llama
    return LLM(model, tokenizer=tokenizer, max_batch_size=4, max_batch_tokens=32, page_size=8, progress=False)


def test_prompt_scores_equal_the_models_log_softmax_through_chunks_beside_plain_requests(engine, llama):
    model, _ = llama
    g = torch.Generator().manual_seed(3)
    scored = torch.randint(3, 259, (45,), generator=g).tolist()  # longer than max_batch_tokens: chunked
    plain = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (7, 12)]
    params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, prompt_logprobs=3),
              SamplingParams(max_new_tokens=4)]
    before = engine.stats()["recompiles"]
    out = engine.generate([plain[0], scored, plain[1]], params)
    assert engine.stats()["recompiles"] == before
    _check_scores(out[1].prompt_logprobs, scored, _eager_logprobs(model, scored), top_k=3)
    assert out[0].prompt_logprobs is None and out[2].prompt_logprobs is None
    # scoring changes nothing of the generation: the same prompts alone give the same tokens
    alone = engine.generate([plain[0], scored, plain[1]], SamplingParams(max_new_tokens=4))
    assert [c.token_ids for c in out] == [c.token_ids for c in alone]


def test_a_scored_prompt_is_computed_whole_even_when_the_prefix_cache_holds_it(engine, llama):
    model, _ = llama
    prompt = torch.randint(3, 259, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    engine.generate([prompt], SamplingParams(max_new_tokens=2))  # caches the prompt's pages
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    assert out.cached_tokens == 0
    _check_scores(out.prompt_logprobs, prompt, _eager_logprobs(model, prompt), top_k=0)
    (again,) = engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert again.cached_tokens > 0  # the scored request's pages serve later prompts as usual


def test_record_skips_positions_already_scored_after_a_recompute():
    prompt = [5, 6, 7, 8]
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    scores: list = [None]
    record(scores, prompt, 0, logits[:2], 1)  # first chunk: positions 0, 1 score tokens 1, 2
    assert [s.token_id for s in scores[1:]] == [6, 7]
    record(scores, prompt, 0, logits, 1)  # recomputed from 0 after preemption: only token 3 is new
    assert [s.token_id for s in scores[1:]] == [6, 7, 8]
    assert scores[3] == PromptLogprob(8, float(torch.log_softmax(logits[2], -1)[8]), scores[3].top)
    record(scores, prompt, 4, logits[:1], 1)  # a generated token's row scores nothing of the prompt
    assert len(scores) == 4


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_prompt_logprobs_out_of_range_is_refused(value):
    with raises_naming(ConfigError, "prompt_logprobs", repr(value), "20"):
        SamplingParams(prompt_logprobs=value)
