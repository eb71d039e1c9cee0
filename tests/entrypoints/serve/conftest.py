"""``kvgraph serve`` as users run it: a subprocess of this interpreter on a free 127.0.0.1 port."""

from __future__ import annotations

import openai
import pytest

from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.launch import ServerProcess
from kvgraph.presets import load_preset
from tests.entrypoints.serve.serving import ENGINE_FLAGS, MAX_SEQ_LEN, MODEL


@pytest.fixture(scope="session")
def start_server():
    """``start_server(*args)`` -> a ready ``ServerProcess``; every one is stopped at the end."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        try:
            server.wait_ready()
        except RuntimeError as e:
            pytest.fail(str(e))
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="module")
def server(start_server):
    """A server of ``ENGINE_FLAGS``, one per test module."""
    return start_server(*ENGINE_FLAGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The same model and engine settings in this process."""
    model, tokenizer = load_preset(MODEL)
    return LLM(model, tokenizer=tokenizer, compile="eager", max_seq_len=MAX_SEQ_LEN, max_batch_size=32)
