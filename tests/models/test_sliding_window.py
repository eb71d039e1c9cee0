"""Hugging Face decoders with local (sliding-window) attention generate like their own ``generate``.

The window is read from the model's config and proven on its mask, carried by each lowered site
to the fused op and applied by the kernel over the paged or continuous cache: prompts and
generations run past the window, and a single sequence decodes through Dynamo's ``T == 1`` graph,
which takes the windows of the config (or, without them, of the several-token graph).
"""

import pytest
import torch
import transformers

import kvgraph
from kvgraph import KVRequest, WindowNotShownError
from kvgraph.compiler.backend import BackendOptions, KVGraphBackend
from kvgraph.compiler.hf import config_windows
from kvgraph.compiler.step import run_step
from tests.models.tiny_models import (
    COMMON,
    VOCAB,
    _build,
    kv_params,
    make_manager,
    reference_greedy,
)
from tests.naming import raises_naming
from tests.passes.lowering_helpers import tiny_llama

NEW_TOKENS = 24
PROMPTS = [[5, 9, 17, 33, 2, 8, 1, 4, 4, 4, 70], [7, 3], [100, 3, 3, 8, 64, 1]]
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def mistral(window: int = 6):
    return _build(transformers.MistralForCausalLM, transformers.MistralConfig(
        **COMMON, **SIZES, sliding_window=window), seed=0)


def qwen2_local_second_layer():
    """Layer 0 full attention, layer 1 a window of 5 (``max_window_layers=1``)."""
    return _build(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        **COMMON, **SIZES, use_sliding_window=True, sliding_window=5, max_window_layers=1), seed=0)


def gemma3():
    """Gemma 3: local layers (window 4) and a global one, each with its own RoPE base."""
    config = transformers.Gemma3TextConfig(**COMMON, **SIZES, head_dim=16, sliding_window=4,
                                           layer_types=["sliding_attention", "full_attention"])
    return _build(transformers.Gemma3ForCausalLM, config, seed=0)


def windows_of(llm: kvgraph.LLM) -> list:
    [runner] = [r for r in llm.runner.compiled.backend.runners if r.layouts][:1]
    [lowered] = runner.layouts.values()
    return [s.sliding_window for s in lowered.result.sites]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["paged", "continuous"])
@pytest.mark.parametrize(("factory", "windows"), [
    (mistral, [6, 6]), (qwen2_local_second_layer, [None, 5]), (gemma3, [4, None]),
], ids=["mistral", "qwen2", "gemma3"])
def test_batched_generation_past_the_window_equals_generate(factory, windows, strategy):
    model = factory()
    refs = [reference_greedy(model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]
    page = {"page_size": 4} if strategy == "paged" else {}
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=4, max_seq_len=64,
                      cache_strategy=strategy, **page)
    done = llm.generate(PROMPTS, kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [d.token_ids for d in done] == refs
    assert windows_of(llm) == windows


@pytest.mark.slow
def test_one_sequence_decodes_through_the_one_token_graph():
    model = mistral(window=5)
    prompt = PROMPTS[0]
    ref = reference_greedy(model, prompt, NEW_TOKENS).tokens[0]
    # traced, not loaded: an earlier run's precompiled files of the same model would hold no lowerings to look at
    llm = kvgraph.LLM(model, compile="inductor", progress=False, max_batch_size=2, max_seq_len=64, page_size=4,
                      precompile=False)
    assert llm.generate([prompt], kvgraph.SamplingParams(max_new_tokens=NEW_TOKENS))[0].token_ids == ref
    graphs = [r for r in llm.runner.compiled.backend.runners if r.layouts]
    assert len(graphs) == 2  # several tokens, then T == 1 with the windows of the first
    for runner in graphs:
        [lowered] = runner.layouts.values()
        assert [s.sliding_window for s in lowered.result.sites] == [5, 5]


@pytest.mark.parametrize("from_config", [True, False], ids=["config", "graph"])
def test_a_one_token_first_step_takes_the_models_windows(from_config, monkeypatch):
    """The first step is one sequence of one token. The one-token graph takes the windows of the
    model's config; without them the engine lowers the several-token graph on a scratch cache
    first, whose windows it takes. Either way the output is generate's."""
    model = mistral(window=5)
    if not from_config:
        monkeypatch.setattr("kvgraph.compiler.backend.config_windows", lambda model: None)
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=2, max_seq_len=64, page_size=4)
    assert llm.runner.compiled.windows_known == from_config
    ref = reference_greedy(model, [9], 12).tokens[0]
    assert llm.generate([[9]], kvgraph.SamplingParams(max_new_tokens=12))[0].token_ids == ref
    assert llm.manager.num_claimed == 0
    assert windows_of(llm) == [5, 5]


def test_by_name_one_token_without_windows_is_refused_clearly():
    """By name each graph is lowered alone: a one-token graph with no windows given is refused with
    what to do; given the windows it lowers, and so does a backend of the model's own after a
    several-token step."""
    model = mistral(window=5)
    manager = make_manager(kv_params(model, "paged"))

    def step(compiled, tokens: list[int]) -> None:
        (seq,) = manager.claim(1)
        try:
            run_step(lambda **kw: compiled(**kw, use_cache=False), manager, [KVRequest(seq, tokens)])
        finally:
            manager.release(seq)

    by_name = torch.compile(model, backend="kvgraph", options={"inner": "eager"})
    with raises_naming(WindowNotShownError, "1 tokens", "size 5", "sliding window", "windows option"):

        step(by_name, [9])
    torch._dynamo.reset()
    step(torch.compile(model, backend="kvgraph", options={"inner": "eager", "windows": [5, 5]}), [9])
    torch._dynamo.reset()
    own = torch.compile(model, backend=KVGraphBackend(BackendOptions(inner="eager")), dynamic=True)
    step(own, [9, 10, 11])
    step(own, [12])


@pytest.mark.parametrize(("factory", "windows"), [
    (mistral, (6, 6)), (qwen2_local_second_layer, (None, 5)), (gemma3, (4, None)),
    (tiny_llama, None),
], ids=["mistral", "qwen2", "gemma3", "llama"])
def test_windows_are_read_from_the_config(factory, windows):
    assert config_windows(factory()) == windows


def test_the_default_mistral_window_of_4096_is_proven_and_kept():
    model = _build(transformers.MistralForCausalLM, transformers.MistralConfig(**COMMON, **SIZES), seed=0)
    assert model.config.sliding_window == 4096
    llm = kvgraph.LLM(model, compile="eager", progress=False, max_batch_size=2, max_seq_len=64)
    ref = reference_greedy(model, PROMPTS[2], 8).tokens[0]
    assert llm.generate([PROMPTS[2], PROMPTS[1]], kvgraph.SamplingParams(max_new_tokens=8))[0].token_ids == ref
    assert windows_of(llm) == [4096, 4096]
    torch._dynamo.reset()
