"""Several prompts in one ``/v1/completions`` request (a list of texts or of token-id lists, as
lm-evaluation-harness sends a batch): choice ``p * n + i`` is sample ``i`` of prompt ``p`` and equals
what that prompt alone gets; a bad prompt among them queues none; pages all free afterwards. A real
server process and the ``openai`` client, and ``start_prompts`` itself."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.serve.protocol import MAX_PROMPTS
from kvgraph.entrypoints.serve.samples import Samples, start_prompts
from tests.entrypoints.serve.serving import MAX_SEQ_LEN, MODEL, all_pages_free, post

TEXTS = ["The first prompt", "A second, longer prompt than the first", "third"]
IDS = [list(range(20, 45)), list(range(60, 70))]


@pytest.fixture(autouse=True)
def pages_freed_after_each_test(server):
    yield
    assert all_pages_free(server)


def test_each_text_prompt_gets_what_it_gets_alone(client, reference):
    out = client.completions.create(model=MODEL, prompt=TEXTS, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = reference.generate(TEXTS, SamplingParams(max_new_tokens=6))
    assert [c.text for c in out.choices] == [a.text for a in alone]
    assert [c.finish_reason for c in out.choices] == [a.finish_reason for a in alone]
    assert out.usage.prompt_tokens == sum(len(reference.encode(t)) for t in TEXTS)
    assert out.usage.completion_tokens == sum(len(a.token_ids) for a in alone)


def test_n_seeded_samples_of_each_token_prompt_come_prompt_by_prompt(client, reference):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=5, n=2, temperature=1.0, seed=5,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == sum(map(len, IDS)) and out.usage.completion_tokens == 4 * 5
    for p, prompt in enumerate(IDS):
        for i in range(2):
            (alone,) = reference.generate([prompt], SamplingParams(max_new_tokens=5, temperature=1.0, seed=5 + i,
                                                                   ignore_eos=True))
            assert out.choices[2 * p + i].text == alone.text


def test_streamed_prompts_come_by_index_and_join_to_the_whole(client):
    args = dict(model=MODEL, prompt=TEXTS, max_tokens=5, temperature=0.8, seed=2)
    whole = client.completions.create(**args)
    texts = {i: "" for i in range(len(TEXTS))}
    finished = set()
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == set(texts)
    assert [texts[i] for i in sorted(texts)] == [c.text for c in whole.choices]


def test_echo_scores_each_prompt_as_alone(client):
    """lm-evaluation-harness's log-likelihood batch: echo, logprobs, one token."""
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert len(out.choices) == len(IDS)
    for prompt, choice in zip(IDS, out.choices, strict=True):
        (alone,) = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                             temperature=0).choices
        assert choice.text == alone.text
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt) + 1
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)


def test_streamed_echo_comes_first_for_each_prompt(client):
    args = dict(model=MODEL, prompt=IDS, max_tokens=2, echo=True, logprobs=1, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert [tokens[0], tokens[1]] == [c.logprobs.tokens for c in whole.choices]
    assert [len(tokens[p]) for p in (0, 1)] == [len(prompt) + 2 for prompt in IDS]


def test_echo_of_the_prompts_alone_counts_no_generated_tokens(client):
    out = client.completions.create(model=MODEL, prompt=IDS, max_tokens=0, echo=True, logprobs=0)
    assert [len(c.logprobs.tokens) for c in out.choices] == [len(p) for p in IDS]
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert out.usage.prompt_tokens == sum(map(len, IDS)) and out.usage.completion_tokens == 0


def test_best_of_ranks_the_samples_of_each_prompt_apart(client):
    args = dict(model=MODEL, max_tokens=4, n=1, best_of=3, temperature=1.0, seed=9, logprobs=0,
                extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=IDS, **args)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 2 * 3 * 4
    for prompt, choice in zip(IDS, out.choices, strict=True):
        (alone,) = client.completions.create(prompt=prompt, **args).choices
        assert choice.text == alone.text


def test_a_bad_prompt_among_several_queues_none_of_them(server, client):
    steps, admitted = server.metric("kvgraph_steps_total"), server.metric("kvgraph_prompt_tokens_total")
    code, body = post(server, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [IDS[0], [3, 259]], "max_tokens": 4}).encode())
    assert code == 400 and "prompt token 259 is not an id in [0, 259)" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        client.completions.create(model=MODEL, prompt=["fine", ""], max_tokens=4, echo=True)
    # the texts are tokenized (and checked) before any is queued: the valid ones are not run first
    too_long = "word " * 2 * MAX_SEQ_LEN
    with pytest.raises(openai.BadRequestError, match=f"is longer than max_seq_len={MAX_SEQ_LEN}"):
        client.completions.create(model=MODEL, prompt=[*TEXTS, too_long], max_tokens=64)
    assert server.metric("kvgraph_steps_total") == steps
    assert server.metric("kvgraph_prompt_tokens_total") == admitted


def test_more_prompts_than_the_limit_are_refused(server):
    code, body = post(server, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [[5]] * (MAX_PROMPTS + 1)}).encode())
    assert code == 400
    assert f"got {MAX_PROMPTS + 1} prompts; one request holds at most {MAX_PROMPTS}" in body["error"]["message"]


# -- start_prompts alone --
class _Handle:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self, reason: str = "abort") -> None:
        self.aborted = True


class _Gen:
    def __init__(self, prompt: int) -> None:
        self.prompt, self.handle = prompt, _Handle()


def test_start_prompts_aborts_every_queued_sample_when_one_prompt_fails():
    started: list[Samples] = []

    async def start_one(p: int) -> Samples:
        await asyncio.sleep(0.01 * p)
        if p == 2:
            raise ValueError("prompt 2 refused")
        samples = Samples([_Gen(p), _Gen(p)])
        started.append(samples)
        return samples

    with pytest.raises(ValueError, match="prompt 2 refused"):
        asyncio.run(start_prompts(4, start_one))
    assert len(started) >= 2  # prompts 0 and 1 were queued before prompt 2 failed
    assert all(gen.handle.aborted for samples in started for gen in samples.gens)


def test_start_prompts_joins_the_samples_prompt_by_prompt():
    async def start_one(p: int) -> Samples:
        await asyncio.sleep(0.01 * (3 - p))  # the last prompt is queued first
        return Samples([_Gen(p) for _ in range(2)])

    samples = asyncio.run(start_prompts(3, start_one))
    assert [gen.prompt for gen in samples.gens] == [0, 0, 1, 1, 2, 2] and samples.per_prompt == 2
    assert not any(gen.handle.aborted for gen in samples.gens)
