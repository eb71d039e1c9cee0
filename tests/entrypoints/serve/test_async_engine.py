"""The async bridge ends a request whose step the model failed, and keeps serving the others."""

import asyncio

import pytest
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.async_engine import AsyncEngine, EngineFailure
from kvgraph.presets import load_preset


@pytest.fixture
def engine():
    model, tokenizer = load_preset("llama-tiny")
    llm = LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=2, max_seq_len=64, compile="eager",
              progress=False)
    bridge = AsyncEngine(llm)
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


def test_requests_sent_together_join_the_same_step_while_the_engine_is_busy(engine, monkeypatch):
    llm = engine.llm
    steps, joined = [0], []
    step, add = llm.step, llm.add_request

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    def recorded_add(*args, **kwargs):
        joined.append(steps[0])
        return add(*args, **kwargs)

    monkeypatch.setattr(llm, "step", counted_step)
    monkeypatch.setattr(llm, "add_request", recorded_add)

    async def scenario():
        long = await engine.submit([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
        async for _ in long:  # the engine is stepping
            if steps[0] >= 3:
                break
        prompts = [[10 + i, 11 + i, 12 + i] for i in range(16)]
        got = await asyncio.wait_for(asyncio.gather(*(_tokens(engine, p) for p in prompts)), timeout=120)
        long.abort()
        return prompts, got

    prompts, got = asyncio.run(scenario())
    # one step apart at most (the engine thread may take the inbox while they are being sent); queued
    # from worker threads racing the engine thread for its lock, they spread over several steps
    assert len(set(joined[1:])) <= 2, f"16 requests sent together were queued at steps {joined[1:]}"
    assert got == [_hf_greedy(llm.model, p, 3) for p in prompts]
