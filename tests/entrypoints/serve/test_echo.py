"""``echo`` on ``/v1/completions``: the prompt's text and its tokens' log-probabilities first, with
``max_tokens: 0`` the prompt alone (how lm-evaluation-harness scores log-likelihoods), streamed and
not; a real server process and the ``openai`` client; log-probabilities against the model's logits."""

from __future__ import annotations

import pytest
import torch

from kvgraph.entrypoints.llm import LLM
from tests.entrypoints.serve.serving import MODEL, all_pages_free

PROMPT = [5, 60, 7, 200, 31, 60, 7, 99, 14]


@pytest.fixture(autouse=True)
def pages_freed_after_each_test(server):
    yield
    assert all_pages_free(server)


def _prompt_log_softmax(reference: LLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, V]``: position ``p``'s raw log-probabilities of the token at ``p + 1``."""
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits
    return torch.log_softmax(logits[0, :-1].double(), dim=-1)


def _check_prompt_part(lp, reference: LLM, ids: list[int], top: int) -> None:
    expected = _prompt_log_softmax(reference, ids)
    tokenizer = reference.tokenizer
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-4)
        alternatives = lp.top_logprobs[i]
        assert 1 <= len(alternatives) <= top + 1  # the prompt's own token always among them
        assert alternatives[lp.tokens[i]] == lp.token_logprobs[i]
        best = expected[i - 1].topk(top)
        texts = [tokenizer.decode([t]) for t in best.indices.tolist()]
        for text, value in zip(texts, best.values.tolist(), strict=True):
            if texts.count(text) == 1 and text != lp.tokens[i]:  # bytes of one character share U+FFFD
                assert alternatives[text] == pytest.approx(value, abs=1e-4)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, server, reference):
    aborted = 'kvgraph_requests_finished_total{finish_reason="abort"}'
    before = server.metric(aborted)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert server.metric(aborted) == before  # the request finishes, it is not aborted
    choice = out.choices[0]
    assert choice.text == reference.tokenizer.decode(PROMPT)
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(PROMPT)
    _check_prompt_part(choice.logprobs, reference, PROMPT, top=2)
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 0


def test_echo_puts_the_prompt_before_the_generated_text_and_tokens(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True, logprobs=1, temperature=0,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=1, temperature=0,
                                      extra_body={"ignore_eos": True})
    prompt_text = reference.tokenizer.decode(PROMPT)
    choice, generated = out.choices[0], plain.choices[0]
    assert choice.text == prompt_text + generated.text
    assert choice.logprobs.tokens == [reference.tokenizer.decode([t]) for t in PROMPT] + generated.logprobs.tokens
    assert choice.logprobs.token_logprobs[len(PROMPT):] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-5)
    # generated tokens' offsets count from the start of the echoed text
    assert choice.logprobs.text_offset[len(PROMPT):] == [len(prompt_text) + o for o in generated.logprobs.text_offset]
    _check_prompt_part(choice.logprobs, reference, PROMPT, top=1)
    assert out.usage.completion_tokens == 5


def test_echo_of_a_text_prompt_without_logprobs_returns_the_text_first(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert out.choices[0].text.startswith("Echo me") and out.choices[0].logprobs is None
    alone = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=0, echo=True)
    assert alone.choices[0].text == "Echo me" and alone.usage.completion_tokens == 0


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_joins_to_the_whole(client, max_tokens):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == whole.finish_reason
    joined = [t for c in chunks for t in c.logprobs.tokens]
    assert joined == whole.logprobs.tokens
    scores = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert scores[0] is None and scores[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
