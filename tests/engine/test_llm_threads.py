"""One ``kvgraph.LLM`` driven from many threads: the same outputs as serial runs, shared batches,
aborts across threads, and every page free at the end."""

import queue
import threading
import time
from collections.abc import Callable

import pytest

from kvgraph.engine import SamplingParams
from kvgraph.entrypoints.llm import LLM

THREADS = 8
JOIN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def llm(llama):
    model, tokenizer = llama
    return LLM(model, tokenizer=tokenizer, page_size=4, max_batch_size=16, max_seq_len=64,
               max_batch_tokens=48, compile="eager")


def _all_free(llm: LLM) -> bool:
    m = llm.manager
    return m.free_pages == m.total_pages and m.num_claimed == 0 and not llm.has_unfinished()


def _run_threads(target: Callable[[int], object], n: int = THREADS) -> list[object]:
    """``target(i)`` in ``n`` threads started together; their results in order. Fails on a hang or
    on any thread's exception."""
    results: list[object] = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait(timeout=JOIN_TIMEOUT_S)
            results[i] = target(i)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def _prompts(thread: int) -> list[list[int]]:
    """Three prompts of different lengths per thread; threads share a 4-token prefix in pairs."""
    prefix = [10 + thread // 2] * 4
    return [prefix + [20 + thread, 30 + k] * (k + 1) for k in range(3)]


def _sampling(thread: int) -> list[SamplingParams]:
    """Greedy, seeded sampling, and a length that differs per thread."""
    return [
        SamplingParams(max_new_tokens=6 + thread % 3, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.9, top_k=40, seed=thread, ignore_eos=True),
        SamplingParams(max_new_tokens=4 + thread, ignore_eos=True),
    ]


def test_generate_from_eight_threads_equals_serial_runs(llm):
    serial = [
        [c.token_ids for c in llm.generate(_prompts(i), _sampling(i))] for i in range(THREADS)
    ]
    together = _run_threads(lambda i: [c.token_ids for c in llm.generate(_prompts(i), _sampling(i))])
    assert together == serial
    assert _all_free(llm)


def test_stream_from_eight_threads_equals_serial_runs(llm):
    def tokens_and_text(i: int) -> tuple[list[list[int]], list[str]]:
        ids: list[list[int]] = [[], [], []]
        text = ["", "", ""]
        for event in llm.stream(_prompts(i), _sampling(i)):
            ids[event.prompt_index].append(event.token_id)
            text[event.prompt_index] += event.text
        return ids, text

    serial = [tokens_and_text(i) for i in range(THREADS)]
    together = _run_threads(tokens_and_text)
    assert together == serial
    for ids, text in together:
        assert text == [llm.tokenizer.decode(t, skip_special_tokens=True) for t in ids]
    assert _all_free(llm)


def test_requests_of_different_callers_share_a_step(llm):
    """While the first caller hands out its first token (the lock released), a second caller queues
    a request; the next step batches both."""
    other_done: queue.Queue = queue.Queue()
    started: list[threading.Thread] = []

    def start_other_caller(events) -> None:
        if started:
            return
        thread = threading.Thread(
            target=lambda: other_done.put(llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=4))),
            daemon=True,
        )
        started.append(thread)
        thread.start()
        for _ in range(10_000):  # until the other request is queued (or done)
            stats = llm.stats()
            if stats["requests_waiting"] + stats["requests_running"] == 2 or not thread.is_alive():
                break
            time.sleep(0.001)

    llm.reset_stats()
    (first,) = llm.generate([[3, 4, 5, 6]], SamplingParams(max_new_tokens=8, ignore_eos=True),
                            on_step=start_other_caller)
    (other,) = other_done.get(timeout=JOIN_TIMEOUT_S)
    assert len(first.token_ids) == 8 and other.finish_reason in ("stop", "length")
    assert 2 in llm.stats()["batch_size_histogram"]
    assert _all_free(llm)


def test_abort_from_another_thread_ends_the_callers_generate(llm):
    seen: queue.Queue = queue.Queue()
    aborted = threading.Event()

    def first_token_then_wait(events) -> None:
        if not aborted.is_set():
            seen.put(events[0].request_id)
            aborted.wait(timeout=JOIN_TIMEOUT_S)

    result: queue.Queue = queue.Queue()
    caller = threading.Thread(
        target=lambda: result.put(llm.generate([[40] * 20], SamplingParams(max_new_tokens=30, ignore_eos=True),
                                               on_step=first_token_then_wait)),
        daemon=True,
    )
    caller.start()
    request_id = seen.get(timeout=JOIN_TIMEOUT_S)
    free = llm.manager.free_pages
    llm.abort(request_id)
    assert llm.manager.free_pages > free
    aborted.set()
    (out,) = result.get(timeout=JOIN_TIMEOUT_S)
    assert out.finish_reason == "abort" and len(out.token_ids) == 1
    assert _all_free(llm)


def test_add_request_abort_and_pop_from_threads(llm):
    """Threads queue requests with ``add_request``, half of them abort theirs, one thread steps the
    engine by hand: the kept requests equal their serial runs and nothing leaks."""
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True)
    prompts = [[50 + i, 60, 70 + i] for i in range(THREADS)]
    serial = [c.token_ids for c in llm.generate(prompts, sampling)]

    def add_and_maybe_abort(i: int) -> int:
        request_id = llm.add_request(prompts[i], sampling)
        if i % 2:
            llm.abort(request_id)
        return request_id

    ids = _run_threads(add_and_maybe_abort)
    for _ in range(1000):
        if not llm.has_unfinished():
            break
        llm.step()
    outs = [llm.pop(request_id) for request_id in ids]
    for i, out in enumerate(outs):
        if i % 2:
            assert out.finish_reason == "abort" and out.token_ids == []
        else:
            assert out.token_ids == serial[i]
    assert _all_free(llm)
