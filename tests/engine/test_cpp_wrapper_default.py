"""The engine's default on the CPU, Inductor's C++ wrapper (the suite otherwise keeps the Python one,
``tests/conftest.py``): greedy outputs equal Hugging Face's, each compiled graph's wrapper is
C++, int8 weights give the Python wrapper's tokens, and ``KVGRAPH_CPP_WRAPPER`` is checked."""

import pytest
import torch

import kvgraph
from kvgraph import LLM, SamplingParams
from kvgraph.compiler.backend import CPP_WRAPPER_ENV, BackendOptions
from kvgraph.errors import ConfigError
from tests.engine.test_quantization import SCHEME, bf16, token_stream


@pytest.fixture
def cpp_entries(cpp_entries, monkeypatch) -> list:
    """The C++ wrappers Inductor loads (``tests/conftest.py``), with the default restored: no
    ``KVGRAPH_CPP_WRAPPER``."""
    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    return cpp_entries


@pytest.mark.slow
def test_the_default_engine_runs_cpp_wrappers_and_matches_hf_greedy(llama, hf_greedy, cpp_entries):
    model, _ = llama
    llm = LLM(model, page_size=8, max_batch_size=4, max_seq_len=64, progress=False, precompile=False)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 7) for p in prompts]
    stats = llm.stats()
    assert len(cpp_entries) >= stats["compiled_graphs"] >= 1  # each compiled graph's wrapper is C++
    assert stats["recompiles"] == 0 and llm.manager.free_pages == llm.manager.total_pages


@pytest.mark.slow
def test_int8_weights_give_the_python_wrappers_tokens(cpp_entries):
    prompts = [token_stream(8, seed) for seed in range(3)]
    tokens = {}
    for cpp_wrapper in (None, False):
        cpp_entries.clear()
        llm = kvgraph.LLM(bf16("llama-tiny", SCHEME, lm_head=True), max_batch_size=4, max_seq_len=64,
                          progress=False, precompile=False, cpp_wrapper=cpp_wrapper)
        done = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        tokens[cpp_wrapper] = [o.token_ids for o in done]
        assert bool(cpp_entries) is (cpp_wrapper is None)
    assert tokens[None] == tokens[False]


@pytest.mark.parametrize("env, asked, device, in_cpp", [
    (None, None, "cpu", True), (None, None, "cuda", False), (None, True, "cuda", True), (None, False, "cpu", False),
    ("0", None, "cpu", False), ("1", None, "cuda", True), ("1", False, "cpu", False),
])
def test_which_wrapper_a_graph_gets(monkeypatch, env, asked, device, in_cpp):
    if env is None:
        monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    else:
        monkeypatch.setenv(CPP_WRAPPER_ENV, env)
    assert BackendOptions(cpp_wrapper=asked).wrapper_in_cpp(torch.device(device)) is in_cpp


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(CPP_WRAPPER_ENV, "yes")
    with pytest.raises(ConfigError, match=r"KVGRAPH_CPP_WRAPPER.*'yes'"):
        BackendOptions().wrapper_in_cpp(torch.device("cpu"))
