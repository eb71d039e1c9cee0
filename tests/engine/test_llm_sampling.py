"""Penalties, logit_bias, min_tokens and logprobs through the whole engine, against the model's own
eager logits (the whole sequence recomputed each step, the penalties applied by hand)."""

import pytest
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import RequestError

PROMPTS = [[5, 6, 7, 8, 9, 5, 6], [40, 41], [100, 3, 7, 7]]


@pytest.fixture(scope="module", params=[1, 4], ids=["one-step", "multistep"])
def llm(llama, request):
    model, tokenizer = llama
    return LLM(model, tokenizer=tokenizer, page_size=8, max_batch_size=4, max_seq_len=64, num_steps=request.param,
               compile="eager")


def _eager_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``float32 [len(ids), V]``: the model's logits at every position, no cache."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits[0].float()


def _penalized_greedy(model, prompt: list[int], n: int, frequency: float, presence: float, repetition: float):
    ids = list(prompt)
    for _ in range(n):
        x = _eager_logits(model, ids)[-1]
        out = torch.tensor(ids[len(prompt):], dtype=torch.int64)
        counts = torch.bincount(out, minlength=x.shape[0]).float()
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[ids] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - presence * (counts > 0) - frequency * counts
        ids.append(int(x.argmax()))
    return ids[len(prompt):]


def test_penalized_greedy_equals_the_eager_oracle(llm, llama):
    model, _ = llama
    p = SamplingParams(max_new_tokens=10, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                       repetition_penalty=1.2)
    plain = SamplingParams(max_new_tokens=10, ignore_eos=True)
    outs = llm.generate(PROMPTS + PROMPTS[:1], [p, p, p, plain])
    for prompt, out in zip(PROMPTS, outs, strict=False):
        assert out.token_ids == _penalized_greedy(model, prompt, 10, 1.5, 0.5, 1.2)
    assert outs[3].token_ids == _penalized_greedy(model, PROMPTS[0], 10, 0.0, 0.0, 1.0)
    assert outs[3].token_ids != outs[0].token_ids


def test_logprobs_equal_the_log_softmax_of_the_model(llm, llama):
    model, _ = llama
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=5),
              SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=3, logprobs=2),
              SamplingParams(max_new_tokens=8, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params)
    assert outs[2].logprobs is None
    for prompt, out, p in zip(PROMPTS, outs[:2], params, strict=False):
        assert len(out.logprobs) == len(out.token_ids) == 8
        logp = torch.log_softmax(_eager_logits(model, prompt + out.token_ids)[len(prompt) - 1 : -1]
                                 / (p.temperature or 1.0), dim=-1)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(logp[i, token].item(), abs=1e-4)
            top = logp[i].topk(p.logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if p.greedy:
            assert all(lp.top[0][0] == token for token, lp in zip(out.token_ids, out.logprobs, strict=True))


def test_stream_events_carry_the_logprobs(llm):
    p = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    (whole,) = llm.generate([PROMPTS[1]], p)
    events = list(llm.stream([PROMPTS[1]], p))
    assert [e.logprobs for e in events] == whole.logprobs


def test_min_tokens_holds_back_a_favoured_eos(llm):
    eos = llm.eos_token_ids[0]
    p = SamplingParams(max_new_tokens=10, min_tokens=3, logit_bias={eos: 100.0})
    (out,) = llm.generate([PROMPTS[0]], p)
    # three tokens before the EOS may come, and then it does
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:3]


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_queueing(llm):
    with pytest.raises(RequestError, match=r"logit_bias token 259 is not an id in \[0, 259\)"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(), SamplingParams(logit_bias={259: 1.0})])
    m = llm.manager
    assert m.free_pages == m.total_pages and not llm.has_unfinished()
