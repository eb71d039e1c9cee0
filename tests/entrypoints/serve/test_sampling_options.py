"""``kvgraph serve``'s penalties, ``logit_bias``, ``min_tokens``, log-probabilities and
``/tokenize`` / ``/detokenize``, end to end: a real server process and the ``openai`` client.

Outputs are checked against ``kvgraph.LLM`` in this process, and log-probabilities against the
model's own logits; after every test the server's engine holds no page.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from tests.entrypoints.serve.serving import MAX_SEQ_LEN, MODEL, all_pages_free, post

PROMPT = [5, 60, 7, 200, 31, 60, 7]


@pytest.fixture(autouse=True)
def pages_freed_after_each_test(server):
    yield
    assert all_pages_free(server)


def _log_softmax(reference: LLM, ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """``[len(ids) - start, V]``: the log-probabilities of positions ``start..`` from the model's own
    logits (whole sequence, no cache)."""
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None]).logits
    return torch.log_softmax(logits[0, start - 1 : -1].float() / temperature, dim=-1)


def test_penalties_and_logit_bias_give_the_engine_s_text(client, reference):
    fields = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"101": 5.0, "60": -100})
    extra = dict(repetition_penalty=1.3, ignore_eos=True)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, **fields,
                                    extra_body=extra)
    (ref,) = reference.generate([PROMPT], SamplingParams(
        max_new_tokens=12, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
        logit_bias={101: 5.0, 60: -100.0}, ignore_eos=True))
    (plain,) = reference.generate([PROMPT], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out.choices[0].text == ref.text != plain.text
    assert 60 not in ref.token_ids


def test_min_tokens_holds_back_the_eos(client, reference):
    eos = reference.eos_token_ids[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logit_bias={str(eos): 100},
                                    extra_body={"min_tokens": 3})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[1]  # in the first tokens' text: it would end the answer there
    cut = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True}).choices[0].text
    held = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 6})
    assert cut == full[: full.index(stop)]
    assert len(held.choices[0].text) > len(cut) + 1 and full.startswith(held.choices[0].text)
    assert held.usage.completion_tokens > 6


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_completion_logprobs_equal_the_model_s(client, reference, temperature):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=temperature, seed=5,
                                    logprobs=3, extra_body={"ignore_eos": True})
    (ref,) = reference.generate([PROMPT], SamplingParams(max_new_tokens=8, temperature=temperature, seed=5,
                                                         ignore_eos=True))
    lp = out.choices[0].logprobs
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in ref.token_ids]
    logp = _log_softmax(reference, PROMPT + ref.token_ids, len(PROMPT), temperature or 1.0)
    expected = logp.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
    assert lp.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs, strict=True)):
        # the byte tokenizer decodes the bytes of longer characters alike ("\ufffd"): keys may collide
        assert top[token] == pytest.approx(lp.token_logprobs[i], abs=1e-4) and len(top) <= 4
        allowed = [*logp[i].topk(3).values.tolist(), lp.token_logprobs[i]]
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in top.values())
        if temperature == 0:
            assert max(top.values()) == top[token]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert len(out.choices[0].text) >= lp.text_offset[-1]


def test_streamed_completion_logprobs_join_to_the_whole(client):
    args = dict(model=MODEL, prompt="Logprobs stream", max_tokens=12, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].logprobs
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**args, stream=True):
        for key in joined:
            joined[key] += getattr(chunk.choices[0].logprobs, key)
    # the second request's prompt comes from the prefix cache: the same up to float rounding
    assert joined["tokens"] == whole.tokens and joined["text_offset"] == whole.text_offset
    assert joined["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-5)
    for streamed, one in zip(joined["top_logprobs"], whole.top_logprobs, strict=True):
        assert streamed == pytest.approx(one, abs=1e-5)


def test_chat_logprobs_shape_streamed_and_not(client, reference):
    messages = [{"role": "user", "content": "Hello there"}]
    args = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**args)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    streamed = [entry for chunk in client.chat.completions.create(**args, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs] for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content


def test_chat_logprobs_without_alternatives(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                         temperature=0, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in out.choices[0].logprobs.content)


def test_tokenize_and_detokenize_round_trip(server, client, reference):
    code, body = post(server, "/tokenize", json.dumps({"model": MODEL, "prompt": "Hello, kvgraph"}).encode())
    assert code == 200
    assert body == {"tokens": reference.tokenizer.encode("Hello, kvgraph"), "count": len(body["tokens"]),
                    "max_model_len": MAX_SEQ_LEN, "token_strs": None}
    code, back = post(server, "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert code == 200 and back["prompt"] == reference.tokenizer.decode(body["tokens"])
    assert back["prompt"].endswith("Hello, kvgraph")
    messages = [{"role": "user", "content": "Count me"}]
    code, chat = post(server, "/tokenize", json.dumps({"messages": messages}).encode())
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert code == 200 and chat["count"] == used


BAD_REQUESTS = {
    "presence_penalty over 2": ("/v1/completions", {"presence_penalty": 2.5},
                                "presence_penalty: Input should be less than or equal to 2 (got 2.5)"),
    "frequency_penalty under -2": ("/v1/completions", {"frequency_penalty": -3},
                                   "frequency_penalty: Input should be greater than or equal to -2 (got -3)"),
    "repetition_penalty 0": ("/v1/completions", {"repetition_penalty": 0},
                             "repetition_penalty: Input should be greater than 0 (got 0)"),
    "logit_bias outside the vocabulary": ("/v1/completions", {"logit_bias": {"300": 1}},
                                          "logit_bias token 300 is not an id in [0, 259)"),
    "logit_bias key not an id": ("/v1/completions", {"logit_bias": {"abc": 1}},
                                 "logit_bias keys must be token ids, got 'abc'"),
    "logit_bias over 100": ("/v1/completions", {"logit_bias": {"5": 150}},
                            "logit_bias of token 5 must be in [-100.0, 100.0]"),
    "min_tokens over max_tokens": ("/v1/completions", {"min_tokens": 20, "max_tokens": 4},
                                   "min_tokens must be an int in [0, max_new_tokens=4], got 20"),
    "logprobs over 20": ("/v1/completions", {"logprobs": 21}, "logprobs: Input should be less than or equal to 20 (got 21)"),
    "max_tokens 0 without echo": ("/v1/completions", {"max_tokens": 0}, "max_tokens=0 needs echo=true"),
    "best_of under n": ("/v1/completions", {"best_of": 2, "n": 3}, "best_of must be in [n=3, 16], got 2"),
    "best_of streamed": ("/v1/completions", {"best_of": 3, "stream": True}, "best_of=3 > n=1 cannot stream"),
    "n over 16": ("/v1/completions", {"n": 17}, "n must be in [1, 16], got 17"),
    "n 0 on chat": ("/v1/chat/completions", {"n": 0}, "n must be in [1, 16], got 0"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs=2 needs logprobs=true"),
    "top_logprobs over 20": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30},
                             "top_logprobs: Input should be less than or equal to 20 (got 30)"),
    "detokenize outside the vocabulary": ("/detokenize", {"tokens": [5, 259]}, "token 259 is not an id in [0, 259)"),
    "detokenize a negative id": ("/detokenize", {"tokens": [-1]}, "token -1 is not an id in [0, 259)"),
    "tokenize neither": ("/tokenize", {}, "give either prompt or messages"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_values_get_a_400_naming_them(server, case):
    path, fields, message = BAD_REQUESTS[case]
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]} if "chat" in path else (
        {"model": MODEL, "prompt": "x"} if path.startswith("/v1") else {})
    code, body = post(server, path, json.dumps({**base, **fields}).encode())
    assert code == 400, body
    assert message in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_the_openai_client_raises_for_refused_options(client):
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], presence_penalty=9)
