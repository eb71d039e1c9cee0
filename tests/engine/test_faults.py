"""A model that raises in one step fails that step's requests only; the engine serves the rest."""

import pytest
import torch

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import BindingError, CppKernelError

INJECTED = RuntimeError("injected fault")


@pytest.fixture(scope="module")
def llm(llama):
    """Two sequences per step, so that a third request waits outside the failing step."""
    model, tokenizer = llama
    return LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=2, max_seq_len=64, compile="eager")


@pytest.fixture
def fail_on_call(llm, monkeypatch):
    """``fail_on_call(n, error)``: the model raises ``error`` on its ``n``-th call from now (1-based)."""
    compiled = llm.runner.compiled

    def arm(n: int, error: BaseException = INJECTED) -> list[int]:
        calls: list[int] = []

        def forward(*args, **kwargs):
            calls.append(len(calls) + 1)
            if len(calls) == n:
                raise error
            return compiled(*args, **kwargs)

        monkeypatch.setattr(llm.runner, "compiled", forward)
        return calls

    return arm


def all_free(llm: LLM) -> bool:
    m = llm.manager
    return m.free_pages == m.total_pages and m.num_claimed == 0 and not llm.has_unfinished()


def test_a_failing_step_fails_its_requests_and_the_waiting_one_still_matches_greedy(llm, llama, hf_greedy, fail_on_call):
    model, _ = llama
    prompts = [[5] * 7, [6] * 5, [7, 8, 9, 10]]
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.reset_stats()
    calls = fail_on_call(2)  # call 1: prefill of the first two; call 2: their first decode
    a, b, c = llm.generate(prompts, sampling)
    for failed in (a, b):
        assert failed.finish_reason == "error" and failed.error == "RuntimeError: injected fault"
        assert len(failed.token_ids) == 1  # the token of the prefill that succeeded
    assert a.token_ids == hf_greedy(model, prompts[0], 1)
    assert c.finish_reason == "length" and c.error is None
    assert c.token_ids == hf_greedy(model, prompts[2], 4)
    assert len(calls) > 2 and llm.stats()["failed"] == 2
    assert all_free(llm)


def test_the_engine_keeps_serving_after_a_failed_step(llm, llama, hf_greedy, fail_on_call):
    model, _ = llama
    fail_on_call(1)
    (failed,) = llm.generate([[9] * 6], SamplingParams(max_new_tokens=3))
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert all_free(llm)
    (ok,) = llm.generate([[9] * 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert ok.token_ids == hf_greedy(model, [9] * 6, 3)


def test_stream_reports_the_failed_request_once_with_its_error(llm, fail_on_call):
    fail_on_call(2)
    events = list(llm.stream([[4] * 5, [3] * 6], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    failed = [e for e in events if e.finish_reason == "error"]
    assert sorted(e.prompt_index for e in failed) == [0, 1]
    assert all(e.token_id is None and e.error == "RuntimeError: injected fault" for e in failed)
    assert all(e.token_id is not None for e in events if e not in failed)
    assert all_free(llm)


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), BindingError("a kvgraph error"), CppKernelError("building the C++ kernel failed")],
)
def test_interrupts_and_kvgraph_errors_abort_the_step_and_are_raised(llm, fail_on_call, error):
    fail_on_call(2, error)
    with pytest.raises(type(error)):
        llm.generate([[5] * 30, [6] * 9, [7] * 3], SamplingParams(max_new_tokens=8))
    assert all_free(llm)


def test_a_fault_in_one_step_leaves_no_page_behind_across_many_steps(llm, fail_on_call):
    calls = fail_on_call(4)
    out = llm.generate([[i + 3] * (i + 2) for i in range(6)], SamplingParams(max_new_tokens=5, ignore_eos=True))
    reasons = sorted(c.finish_reason for c in out)
    assert reasons.count("error") in (1, 2) and reasons.count("length") == 6 - reasons.count("error")
    assert len(calls) > 4 and all_free(llm)
    assert torch.tensor([len(c.token_ids) for c in out if c.finish_reason == "length"]).eq(5).all()
