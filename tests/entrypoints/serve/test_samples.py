"""``n`` and ``best_of``: several samples of one prompt, the later ones taking the first one's prompt
pages from the prefix cache; seeded samples reproducible; streamed choices by index; pages all free
afterwards. A real server process and the ``openai`` client."""

from __future__ import annotations

import pytest
import torch

from kvgraph.engine import SamplingParams
from tests.entrypoints.serve.serving import MODEL, all_pages_free

PROMPT = list(range(40, 80))  # 40 tokens: two full pages of 16 and a partial one


@pytest.fixture(autouse=True)
def pages_freed_after_each_test(server):
    yield
    assert all_pages_free(server)


def test_n_samples_share_the_prompt_pages_and_each_follows_its_own_seed(client, server, reference):
    prompt = list(range(100, 140))  # no other test sends it: nothing of it is cached before
    hits = server.metric("kvgraph_prefix_hit_tokens_total")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=3, temperature=1.0, seed=11,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 18
    # the 2nd and 3rd samples took the prompt's full pages from the prefix cache
    assert server.metric("kvgraph_prefix_hit_tokens_total") - hits == 2 * 32
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=3, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    # sample i is the request seeded seed + i
    for i, choice in enumerate(out.choices):
        (alone,) = reference.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=11 + i,
                                                               ignore_eos=True))
        assert choice.text == alone.text
    assert len({c.text for c in out.choices}) > 1


def test_streamed_chat_samples_come_by_index_and_join_to_the_whole(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "tell"}], max_tokens=5, n=2, temperature=0.9,
                seed=3)
    whole = client.chat.completions.create(**args)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_best_of_returns_the_n_samples_with_the_highest_log_probability(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, best_of=4, temperature=1.0,
                                    seed=7, logprobs=0, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.usage.completion_tokens == 16
    scores = []
    for i in range(4):
        (c,) = reference.generate([PROMPT], SamplingParams(max_new_tokens=4, temperature=1.0, seed=7 + i,
                                                           ignore_eos=True, logprobs=0))
        scores.append((sum(lp.logprob for lp in c.logprobs), c.text))
    best = [text for _, text in sorted(scores, reverse=True)[:2]]
    assert [c.text for c in out.choices] == best
    summed = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert summed == sorted(summed, reverse=True)
    assert summed[0] == pytest.approx(sorted(scores, reverse=True)[0][0], abs=1e-3)


def test_echo_with_n_scores_the_prompt_once(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT[:10], max_tokens=0, n=2, echo=True, logprobs=1)
    first, second = out.choices
    assert first.text == second.text and first.logprobs.token_logprobs == second.logprobs.token_logprobs
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == 10
    assert torch.tensor(first.logprobs.token_logprobs[1:]).le(0).all()
