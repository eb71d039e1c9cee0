"""The engine process's step loop, run in a thread of this process over real pipes: requests sent
in one message join the same step, an abort frees the pages before the next step, every step is
one message, and a front end that goes away ends the loop with every request freed."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.entrypoints.serve.engine_process import EngineLoop
from kvgraph.presets import load_preset

LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=3, ignore_eos=True)


class Loop:
    """``EngineLoop`` over ``llm`` in a thread; ``send`` and ``recv`` are the front end's ends."""

    def __init__(self, llm: LLM) -> None:
        commands_out, self.commands = multiprocessing.Pipe(duplex=False)
        self.events, events_in = multiprocessing.Pipe(duplex=False)
        self.thread = threading.Thread(target=EngineLoop(llm, commands_out, events_in).run, daemon=True)
        self.thread.start()

    def send(self, *commands: tuple) -> None:
        self.commands.send(list(commands))

    def recv(self) -> tuple:
        assert self.events.poll(120), "the engine loop sent nothing for 120 s"
        return self.events.recv()

    def stop(self) -> None:
        self.send(("stop",))
        self.thread.join(120)
        assert not self.thread.is_alive()


@pytest.fixture
def llm() -> LLM:
    model, tokenizer = load_preset("llama-tiny")
    return LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=32, max_seq_len=64, compile="eager",
               progress=False)


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _pages_used(loop: Loop) -> int:
    """The engine's KV pages in use, asked after what was sent before (steps sent meanwhile skipped)."""
    loop.send(("stats", 0))
    while (message := loop.recv())[0] != "stats":
        assert message[0] == "step"
    return message[2]["kv_pages_used"]


def test_requests_sent_in_one_message_join_the_same_step(llm, monkeypatch):
    steps, joined = [0], {}
    step, add = llm.step, llm.add_request

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    def recorded_add(ids, sampling):
        joined[tuple(ids)] = steps[0]
        return add(ids, sampling)

    monkeypatch.setattr(llm, "step", counted_step)
    monkeypatch.setattr(llm, "add_request", recorded_add)
    loop = Loop(llm)
    loop.send(("add", 100, [1, 2, 3], LONG))
    for _ in range(3):  # the engine is stepping
        assert loop.recv()[0] == "step"
    prompts = {i: [10 + i, 11 + i, 12 + i] for i in range(16)}
    loop.send(*(("add", i, p, SHORT) for i, p in prompts.items()))
    tokens: dict[int, list[int]] = {i: [] for i in prompts}
    finished = set()
    while len(finished) < len(prompts):
        kind, records = loop.recv()
        assert kind == "step"
        assert len({r[0] for r in records}) == len(records)  # one message per step: a token each
        for request_id, token_id, finish_reason, error, _, _ in records:
            assert error is None
            if request_id in tokens:
                tokens[request_id].append(token_id)
                if finish_reason is not None:
                    finished.add(request_id)
    loop.send(("abort", 100))
    assert _pages_used(loop) == 0
    loop.stop()
    assert len({joined[tuple(p)] for p in prompts.values()}) == 1, joined
    assert tokens == {i: _hf_greedy(llm.model, p, 3) for i, p in prompts.items()}


def test_an_abort_frees_the_pages_before_the_next_step(llm):
    loop = Loop(llm)
    loop.send(("add", 7, [5, 6, 7], LONG))
    assert loop.recv()[0] == "step"
    loop.send(("abort", 7))
    assert _pages_used(loop) == 0
    assert llm.stats()["requests_running"] == 0
    loop.stop()


def test_the_loop_ends_and_frees_every_request_when_the_front_end_goes_away(llm):
    loop = Loop(llm)
    loop.send(("add", 1, [5, 6, 7], LONG), ("add", 2, [8, 9], LONG))
    assert loop.recv()[0] == "step"
    loop.commands.close()
    loop.thread.join(120)
    assert not loop.thread.is_alive()
    m = llm.manager
    assert m.free_pages == m.total_pages and m.num_claimed == 0
    assert not llm.has_unfinished()


def test_an_idle_engine_loads_its_compile_workers_graphs_before_any_request(tmp_path, monkeypatch):
    """``--background-compile``: the loop, idle, sees the worker finish and loads its graphs then,
    leaving the stats alone; the first request after runs compiled, with the same tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, tokenizer = load_preset("llama-tiny")
    llm = LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=32, max_seq_len=64, progress=False,
              background_compile=True)
    try:
        llm.warmup()
        assert llm.compiling_in_background
        loop = Loop(llm)
        llm.compiled.wait(600)
        deadline = time.monotonic() + 60
        while llm.runner.loaded_graphs < 1:  # one graph runs every step
            assert time.monotonic() < deadline, "the idle loop did not load the worker's graphs"
            time.sleep(0.1)
        assert llm.stats()["steps"] == 0  # the throwaway requests that loaded them are not counted
        loop.send(("add", 1, [5, 6, 7], SHORT))
        tokens = []
        while len(tokens) < 3:
            kind, records = loop.recv()
            tokens += [r[1] for r in records]
        loop.stop()
        assert tokens == _hf_greedy(model, [5, 6, 7], 3)
        assert llm.stats()["recompiles"] == 0
    finally:
        llm.close()
