"""``kvgraph serve --stream-interval N``: a streamed request's tokens come N to a chunk, the first
at once, and the text is the same as without it."""

from __future__ import annotations

import itertools
import subprocess
import sys

import openai
import pytest

from tests.entrypoints.serve.serving import ENGINE_FLAGS, MODEL

INTERVAL, TOKENS = 5, 16


@pytest.fixture(scope="module")
def interval_client(start_server) -> openai.OpenAI:
    server = start_server(*ENGINE_FLAGS, "--stream-interval", str(INTERVAL))
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_tokens_come_n_to_a_chunk_after_the_first(interval_client):
    args = dict(model=MODEL, prompt="Chunks of five", max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = interval_client.completions.create(**args)
    chunks = [c for c in interval_client.completions.create(**args, stream=True, logprobs=1) if c.choices]
    ends = list(itertools.accumulate(len(c.choices[0].logprobs.tokens) for c in chunks))  # tokens so far
    # the tokens are handed on at the 1st, then every N-th, and the last: a chunk ends at one of those
    # (a piece whose text is still empty, as an incomplete character, waits for the next hand-over)
    assert ends[-1] == TOKENS
    assert all(n % INTERVAL == 1 for n in ends[:-1]), ends
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_bad_interval_is_refused_before_the_server_starts(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvgraph.entrypoints.cli", "serve", *ENGINE_FLAGS,
                          "--stream-interval", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "--stream-interval" in out.stderr and "0" in out.stderr
