"""``kvgraph serve`` end to end: a real server process and the official ``openai`` client.

One server serves the whole module (its start-up compiles the model); the last test stops it
with SIGTERM. Greedy outputs are checked against ``kvgraph.LLM`` run in this process.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.chat import DEFAULT_CHAT_TEMPLATE
from tests.entrypoints.serve.serving import MAX_SEQ_LEN, MODEL, all_pages_free, post, wait_until
from tests.naming import raises_naming

CONCURRENT = 24


def _greedy(llm: LLM, prompt, max_tokens: int):
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=max_tokens))
    return out


def test_health_and_models(server, client):
    assert json.loads(server.get("/health")) == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_the_engine(client, reference):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = _greedy(reference, prompt, 12)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.prompt_tokens and out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == ref.prompt_tokens + len(ref.token_ids)


def test_token_id_prompt(client, reference):
    ids = [5, 60, 7, 200, 31]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == _greedy(reference, ids, 6).text


def test_stream_chunks_join_to_the_non_stream_text(client):
    args = dict(model=MODEL, prompt="Streaming works", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_uses_the_default_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    text = "<|system|>\nBe brief.\n<|user|>\nSay something\n<|assistant|>\n"
    assert reference.tokenizer.apply_chat_template(
        messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    ) == text
    ref = _greedy(reference, reference.tokenizer.encode(text, add_special_tokens=False), 10)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == ref.prompt_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_string_cuts_the_text(client):
    args = dict(model=MODEL, prompt="Stop somewhere", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stop = full[8:10]
    assert len(stop) == 2
    expected = full[: full.index(stop)]
    out = client.completions.create(**args, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seeded_sampling_is_reproducible(client):
    args = dict(model=MODEL, prompt="Sample me", max_tokens=16, temperature=0.9, top_p=0.95, seed=11,
                extra_body={"top_k": 50, "ignore_eos": True})
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_concurrent_requests_equal_their_runs_alone(server, client, reference):
    prompts = [f"Request number {i} says" + " hi" * (i % 5) for i in range(CONCURRENT)]

    def complete(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        together = list(pool.map(complete, prompts))
    assert together == alone
    assert alone == [c.text for c in reference.generate(prompts, SamplingParams(max_new_tokens=16))]
    assert wait_until(lambda: server.metric("kvgraph_kv_pages_used") == 0)
    assert server.metric("kvgraph_requests_running") == 0 and server.metric("kvgraph_requests_waiting") == 0
    # every step ran on some thread count (the governor's), which /metrics splits the steps by
    assert server.metric("kvgraph_steps_by_threads_total") == server.metric("kvgraph_steps_total") > 0


BAD_REQUESTS = {
    "negative max_tokens": ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal to 0 (got -1)"),
    "unknown model": ({"model": "gpt-4", "prompt": "x"}, 404, "model 'gpt-4' does not exist; this server serves 'llama-tiny'"),
    "prompt over max_seq_len": ({"prompt": [5] * (MAX_SEQ_LEN + 1)}, 400, f"prompt of {MAX_SEQ_LEN + 1} tokens is longer than max_seq_len={MAX_SEQ_LEN}"),
    "n > 16": ({"prompt": "x", "n": 17}, 400, "n must be in [1, 16], got 17"),
    "negative temperature": ({"prompt": "x", "temperature": -0.5}, 400, "temperature: Input should be greater than or equal to 0 (got -0.5)"),
    "top_p of 0": ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0 (got 0)"),
    "token outside the vocabulary": ({"prompt": [3, 259]}, 400, r"prompt token 259 is not an id in [0, 259)"),
    "empty prompt": ({"prompt": ""}, 400, "prompt is empty"),
    "no prompt": ({}, 400, "prompt: required"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, client, case):
    fields, status, message = BAD_REQUESTS[case]
    code, body = post(server, "/v1/completions", json.dumps({"model": MODEL, **fields}).encode())
    assert code == status
    assert message in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].text is not None


def test_malformed_json_and_unknown_paths(server):
    code, body = post(server, "/v1/completions", b'{"model": "llama-tiny", "prompt":')
    assert code == 400 and body["error"]["message"].startswith("the body is not valid JSON")
    code, body = post(server, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert code == 400 and "messages" in body["error"]["message"]
    code, body = post(server, "/v1/embeddings", b"{}")
    assert code == 404 and body["error"]["type"] == "not_found_error"


def test_openai_client_raises_the_documented_errors(client):
    with raises_naming(openai.NotFoundError, "model 'nope'") as error:

        client.completions.create(model="nope", prompt="x")
    assert error.value.code == "model_not_found" and error.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)


def test_disconnect_mid_stream_frees_the_pages(server):
    aborted = 'kvgraph_requests_finished_total{finish_reason="abort"}'
    before = server.metric(aborted)
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # the first token arrived
    conn.close()
    assert wait_until(lambda: server.metric(aborted) == before + 1)
    assert wait_until(lambda: server.metric("kvgraph_kv_pages_used") == 0)
    assert server.metric("kvgraph_generated_tokens_total") > 0
    for name in ("kvgraph_time_to_first_token_seconds_count", "kvgraph_inter_token_latency_seconds_count"):
        assert server.metric(name) > 0


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": "a long story"}),
    ("/v1/completions", {"prompt": ["a long story", "another one"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a long story"}]}),
])
def test_a_client_that_leaves_before_a_whole_answer_frees_its_pages(server, path, fields):
    """Not streamed: the samples are aborted when the client goes, not run to their end."""
    aborted = 'kvgraph_requests_finished_total{finish_reason="abort"}'
    before = server.metric(aborted)
    samples = len(fields["prompt"]) * fields["n"] if isinstance(fields.get("prompt"), list) else 1
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": MODEL, "max_tokens": MAX_SEQ_LEN - 32, "temperature": 0, "ignore_eos": True, **fields}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    assert wait_until(lambda: server.metric("kvgraph_requests_running") == samples)
    conn.close()
    assert wait_until(lambda: server.metric(aborted) == before + samples)
    assert all_pages_free(server)


def test_sigterm_finishes_the_request_in_flight_and_exits_0(server, client):
    """Last in the module: it stops the shared server."""
    first_chunk = threading.Event()
    result: dict = {}

    def stream() -> None:
        chunks = []
        for chunk in client.completions.create(model=MODEL, prompt="in flight", max_tokens=100, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk)
            first_chunk.set()
        result["chunks"] = chunks

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first_chunk.wait(120)
    assert server.stop(signal.SIGTERM) == 0
    thread.join(120)
    assert not thread.is_alive()
    chunks = result["chunks"]
    assert chunks[-1].choices[0].finish_reason == "length"
    ready = [line for line in server.log if "ready: serving" in line]
    assert ready and re.search(r"\(started in [0-9.]+s: 2 graphs", ready[0]), ready
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
