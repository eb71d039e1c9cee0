"""The async bridge ends a request whose step the model failed, and keeps serving the others."""

import asyncio

import pytest
import torch

from kvgraph.engine import LLM, SamplingParams
from kvgraph.presets import load_preset
from kvgraph.serve.async_engine import AsyncEngine, EngineFailure
from kvgraph.serve.metrics import ServeMetrics


@pytest.fixture
def engine():
    model, tokenizer = load_preset("llama-tiny")
    llm = LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=2, max_seq_len=64, compile="eager",
              progress=False)
    bridge = AsyncEngine(llm, ServeMetrics(llm))
    bridge.start()
    yield bridge
    bridge.stop()


async def _tokens(bridge: AsyncEngine, prompt: list[int]) -> list[int]:
    handle = await bridge.submit(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    return [event.token_id async for event in handle]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_a_model_fault_ends_its_request_with_an_engine_failure(engine, monkeypatch):
    compiled = engine.llm.runner.compiled
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return compiled(*args, **kwargs)

    monkeypatch.setattr(engine.llm.runner, "compiled", forward)

    async def scenario():
        with pytest.raises(EngineFailure, match="injected fault"):
            await asyncio.wait_for(_tokens(engine, [5, 6, 7]), timeout=60)
        return await asyncio.wait_for(_tokens(engine, [5, 6, 7]), timeout=60)

    tokens = asyncio.run(scenario())
    assert tokens == _hf_greedy(engine.llm.model, [5, 6, 7], 3)
    m = engine.llm.manager
    assert m.free_pages == m.total_pages and m.num_claimed == 0
    failed = engine.metrics.registry.get_sample_value("kvgraph_requests_finished_total", {"finish_reason": "error"})
    assert failed == 1.0
