"""Timed benchmark runs start from an empty prefix cache: a repeat of a workload that shares no
prefix is never served by what an earlier run cached, and one that would be is refused."""

import re

import pytest

from kvgraph.entrypoints.cli.bench import run_kvgraph
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import WarmCacheError
from kvgraph.workloads import make_workload
from tests.naming import raises_naming


@pytest.fixture(scope="module")
def llm():
    engine = LLM("llama-tiny", max_batch_size=4, max_seq_len=640, compile="eager", progress=False)
    yield engine
    engine.close()


@pytest.mark.parametrize("name", ["mixed", "decode-heavy"])
def test_timed_repeats_of_a_workload_without_shared_prefixes_never_hit_the_prefix_cache(llm, name):
    workload = make_workload(name, num_requests=3, vocab_size=llm.vocab_size, max_new_tokens=2)
    first, _ = run_kvgraph(llm, workload)
    # what the first run left would serve every prompt's full pages to the next one
    assert llm.manager.cached_prefix_length(workload.prompts[0]) >= llm.params.page_size
    second, _ = run_kvgraph(llm, workload)
    for result in (first, second):
        assert result.cached_before_tokens == 0 and result.prefix_hit_tokens == 0
    assert second.outputs == first.outputs


def test_a_repeat_that_would_be_served_by_the_previous_run_is_refused(llm, monkeypatch):
    workload = make_workload("mixed", num_requests=2, vocab_size=llm.vocab_size, max_new_tokens=2)
    run_kvgraph(llm, workload)
    monkeypatch.setattr(llm, "reset_prefix_cache", lambda: 0)  # as if the benchmark forgot to reset
    with raises_naming(WarmCacheError, "'mixed'", "prefix cache") as info:
        run_kvgraph(llm, workload)
    assert re.search(r"\b[1-9][0-9]* tokens\b", str(info.value)), str(info.value)


def test_shared_prefix_repeats_hit_only_what_their_own_run_cached(llm):
    workload = make_workload("shared-prefix", num_requests=6, vocab_size=llm.vocab_size, max_new_tokens=2)
    first, _ = run_kvgraph(llm, workload)
    second, _ = run_kvgraph(llm, workload)
    assert first.cached_before_tokens == second.cached_before_tokens == 0
    # the requests of the first step compute the 512-token system prompt; later ones reuse its pages
    assert first.prefix_hit_tokens == second.prefix_hit_tokens >= 512
