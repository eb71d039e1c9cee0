"""kvgraph.LLM end to end on the tiny Llama preset: greedy output equals the model's own eager greedy."""

import pickle

import pytest
import torch

from kvgraph.cache.params import KVCacheParams
from kvgraph.engine import SamplingParams
from kvgraph.engine.stats import kv_usage_text
from kvgraph.entrypoints.llm import LLM
from kvgraph.errors import ConfigError, OutOfPagesError, RequestError, SequenceLengthError
from tests.naming import raises_naming

PAGE = 4
POOL_PAGES = 24


@pytest.fixture(scope="module")
def llm(llama):
    """A paged engine with a tiny pool (24 pages of 4 tokens: less than one max_seq_len=100
    sequence) and a 32-token step budget."""
    model, tokenizer = llama
    c = model.config
    page_bytes = KVCacheParams(torch.float32, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                               c.num_hidden_layers, page_size=PAGE).page_bytes
    return LLM(
        model, tokenizer=tokenizer, page_size=PAGE, max_batch_size=8, max_seq_len=100, max_batch_tokens=32,
        kv_cache_memory=POOL_PAGES * page_bytes, compile="eager",
    )


def _all_free(llm: LLM) -> bool:
    m = llm.manager
    return m.free_pages == m.total_pages and m.num_claimed == 0 and not llm.has_unfinished()


def test_pool_is_the_requested_size(llm):
    assert llm.manager.total_pages == POOL_PAGES and llm.manager.page_size == PAGE


def test_mixed_prompts_with_a_shared_prefix_match_hf_greedy(llm, llama, hf_greedy, shared_prefix_prompts):
    model, _ = llama
    prompts = shared_prefix_prompts(12, [3, 9, 1, 6])
    first = [prompts[0][:12] + [258] * 5]
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    llm.reset_stats()
    llm.generate(first, sampling)  # commits the prefix pages to the prefix cache
    outs = llm.generate(prompts, sampling)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 8)
        assert out.finish_reason == "length" and out.prompt_tokens == len(prompt)
    assert [out.cached_tokens for out in outs] == [12] * 4  # three full pages of the shared prefix
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] >= 48 and stats["prefix_hit_rate"] > 0
    assert _all_free(llm)


def test_chunked_prefill_of_a_prompt_longer_than_the_step_budget(llm, llama, hf_greedy, shared_prefix_prompts):
    model, _ = llama
    (prompt,) = shared_prefix_prompts(0, [70], seed=1)  # 70 > max_batch_tokens=32: three chunks
    llm.reset_stats()
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out.token_ids == hf_greedy(model, prompt, 6)
    stats = llm.stats()
    assert stats["prefill_tokens"] == 70 and stats["steps"] == 3 + 5
    assert _all_free(llm)


def test_preemption_by_recompute_gives_the_unpreempted_output(llm, llama, hf_greedy, shared_prefix_prompts):
    model, _ = llama
    prompts = shared_prefix_prompts(0, [10, 14, 7, 12, 9], seed=2)  # 5 x 7..9 pages > 24 pages
    llm.reset_stats()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert llm.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 20)
    assert _all_free(llm)


def test_abort_frees_the_pages_at_once_and_the_others_finish(llm, llama, hf_greedy, shared_prefix_prompts):
    model, _ = llama
    prompts = shared_prefix_prompts(0, [9, 5, 6], seed=3)
    tokens = {0: [], 1: [], 2: []}
    aborted = False
    for event in llm.stream(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True)):
        tokens[event.prompt_index].append(event.token_id)
        if event.prompt_index == 1 and len(tokens[1]) == 2 and not aborted:
            free = llm.manager.free_pages
            llm.abort(event.request_id)
            assert llm.manager.free_pages > free
            aborted = True
    assert len(tokens[1]) == 2
    assert tokens[0] == hf_greedy(model, prompts[0], 6) and tokens[2] == hf_greedy(model, prompts[2], 6)
    assert _all_free(llm)


def test_stop_tokens_end_the_request_and_are_kept(llm, llama, hf_greedy):
    model, _ = llama
    prompt = [5, 17, 33, 90, 4]
    ref = hf_greedy(model, prompt, 10)
    stop = ref[4]
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop]))
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    prompt = [9, 8, 7, 6, 5]
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    (a,) = llm.generate([prompt], p)
    b = llm.generate([[3, 4, 5], prompt, [200, 100]], [SamplingParams(max_new_tokens=5), p, p])[1]
    (c,) = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_requests_that_can_never_run_are_rejected_up_front(llm):
    with raises_naming(SequenceLengthError, "prompt", "101 tokens", "max_seq_len=100"):
        llm.generate([[5] * 10, [5] * 101])
    with raises_naming(OutOfPagesError, "25 pages", "24 pages", "4 tokens"):
        llm.generate([[5] * 90], SamplingParams(max_new_tokens=8))  # 97 tokens to cache
    llm.generate([[5] * 90], SamplingParams(max_new_tokens=7))  # 96 fit
    with raises_naming(RequestError, "prompt", "empty"):
        llm.generate([[]])
    with raises_naming(RequestError, "prompt token 259", "[0, 259)"):
        llm.generate([[3, 259]])
    assert _all_free(llm)  # nothing was queued, not even the good prompt


def test_request_checks_apart_from_the_engine_refuse_what_it_refuses(llm):
    """What ``kvgraph serve``'s front end checks requests with, in another process than the engine."""
    checks = pickle.loads(pickle.dumps(llm.request_checks()))
    with raises_naming(SequenceLengthError, "101 tokens", "max_seq_len=100"):
        checks.encode([5] * 101)
    with raises_naming(OutOfPagesError, "25 pages", "24 pages", "4 tokens"):
        checks.encode([5] * 90, SamplingParams(max_new_tokens=8))
    with raises_naming(RequestError, "stop token 300", "[0, 259)"):
        checks.encode([5], SamplingParams(stop_token_ids=[300]))
    assert checks.encode([5] * 90, SamplingParams(max_new_tokens=7)) == [5] * 90
    assert checks.encode("Hello, kvgraph") == llm.encode("Hello, kvgraph")
    assert _all_free(llm)


def test_text_prompts_are_tokenized_and_detokenized(llm, llama, hf_greedy):
    model, tokenizer = llama
    (out,) = llm.generate("Hello, kvgraph", SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert out.token_ids == hf_greedy(model, tokenizer.encode("Hello, kvgraph"), 5)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stats_report_the_documented_figures(llm):
    llm.warmup()  # compiled steps are left out of the rates
    llm.generate([[250, 251, 252], [253, 254]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    stats = llm.stats()
    assert stats["batch_size_histogram"] == {2: 4}
    assert stats["decode_tokens"] == 6 and stats["prefill_tokens"] == 5
    assert stats["prefill_tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_free"] == POOL_PAGES
    assert stats["kv_pages_peak"] == 4 and 0 <= stats["kv_waste"] < 1
    assert stats["compiled_graphs"] >= 1 and stats["preemptions"] == 0
    # the governor follows the cores other processes leave free: fewer threads on a busy host
    assert 1 <= stats["threads"] <= torch.get_num_threads() and stats["thread_changes"] >= 0
    assert sum(stats["steps_by_threads"].values()) == stats["steps"] == 4  # each step on the governor's count
    assert all(1 <= threads <= torch.get_num_threads() for threads in stats["steps_by_threads"])


def test_the_startup_note_says_whether_inductor_reused_the_compiled_graphs(llm):
    runner = llm.runner
    for hits, misses, loaded, note in [
        (0, 0, 0, "2 graphs compiled and written to precompiled files"),
        (2, 0, 0, "2 graphs reused from Inductor's on-disk cache"),
        (0, 2, 0, "2 graphs compiled afresh"),
        (1, 1, 0, "2 graphs 1 reused from Inductor's on-disk cache, 1 compiled afresh"),
        (0, 0, 2, "2 graphs loaded whole from precompiled files, no trace"),
        (0, 1, 1, "1 graph loaded whole from precompiled files, no trace; 1 graph compiled afresh"),
    ]:
        runner.written_graphs = 2 if loaded == 0 and hits + misses == 0 else 0
        runner.cache_hits, runner.cache_misses, runner.loaded_graphs = hits, misses, loaded
        assert llm.startup_note() == note
    runner.cache_hits = runner.cache_misses = runner.loaded_graphs = runner.written_graphs = 0
    assert llm.startup_note() == f"{runner.warmup_graphs} graphs, none through Inductor"


def test_the_thread_governor_runs_on_the_cpu_by_default_with_threads_to_govern(llama, monkeypatch):
    model, _ = llama
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert LLM(model, compile="eager", progress=False).threads is not None
    fixed = LLM(model, compile="eager", progress=False, adaptive_threads=False)
    assert fixed.threads is None and fixed.stats()["others_cores"] is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert LLM(model, compile="eager", progress=False).threads is None  # one thread: nothing to take away
    with pytest.raises(ConfigError, match=r"adaptive_threads.*'yes'"):
        LLM(model, adaptive_threads="yes")


def test_a_governed_thread_count_runs_the_steps_on_it_without_recompiling(llama, hf_greedy, monkeypatch,
                                                                          graph_threads):
    model, _ = llama
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("needs two intra-op threads to take one away")
    llm = LLM(model, compile="eager", progress=False)
    llm.warmup()
    graph_threads.clear()
    monkeypatch.setattr(llm.threads, "update", lambda: setattr(llm.threads, "threads", 1) or 1)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 5) for p in prompts]
    assert set(graph_threads) == {1} and torch.get_num_threads() == before
    stats = llm.stats()
    assert stats["recompiles"] == 0 and stats["threads"] == 1


def test_bad_constructor_arguments_raise_before_compiling(llama):
    model, _ = llama
    with pytest.raises(ConfigError, match=r"max_batch_tokens.*positive.*\b0\b"):
        LLM(model, max_batch_tokens=0)
    with pytest.raises(ConfigError, match=r"compile.*'tvm'"):
        LLM(model, compile="tvm")
    with raises_naming(ConfigError, "checkpoint directory", "'/no/such/dir'"):
        LLM("/no/such/dir")


def test_multistep_decoding_matches_single_steps(llama, hf_greedy):
    model, _ = llama
    llm = LLM(model, page_size=8, max_batch_size=4, max_seq_len=64, num_steps=4, compile="eager")
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 3, 7]]
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (11, 6, 9)])
    for prompt, out, n in zip(prompts, outs, (11, 6, 9), strict=True):
        assert out.token_ids == hf_greedy(model, prompt, n)
    stats = llm.stats()
    assert stats["model_calls"] > stats["steps"]  # several decode steps per schedule
    assert llm.manager.free_pages == llm.manager.total_pages


@pytest.mark.slow
@pytest.mark.parametrize("freeze_weights", [True, False], ids=["frozen", "weights-as-inputs"])
def test_inductor_with_and_without_frozen_weights_matches_hf_greedy(llama, hf_greedy, freeze_weights):
    model, _ = llama
    llm = LLM(model, page_size=8, max_batch_size=4, max_seq_len=64, freeze_weights=freeze_weights)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 7) for p in prompts]
    assert llm.compiled.backend.options.freeze_weights is freeze_weights


@pytest.mark.slow
@pytest.mark.parametrize("freeze_weights", [True, False], ids=["frozen", "weights-as-inputs"])
def test_frozen_weights_are_constants_of_the_graph(freeze_weights):
    """Frozen, Dynamo keeps the parameters as constants of the graphs it hands kvgraph (Inductor's
    freezing then folds and packs them); unfrozen they are graph inputs. Neither recompiles."""
    from kvgraph.passes.graph_view import placeholder_kind
    from kvgraph.presets import load_preset

    model, _ = load_preset("llama-tiny", seed=0)
    llm = LLM(model, page_size=8, max_batch_size=2, max_seq_len=64, freeze_weights=freeze_weights, progress=False,
              precompile=False)  # traced here, not loaded from an earlier test's files
    llm.generate([list(range(5, 25))], SamplingParams(max_new_tokens=2))
    runners = llm.compiled.backend.runners
    assert len(runners) == 2
    for runner in runners:
        lifted = [n for n in runner.gm.graph.find_nodes(op="placeholder") if placeholder_kind(n) == "constant"]
        constants = runner.gm.graph.find_nodes(op="get_attr")
        if freeze_weights:
            assert not lifted and len(constants) >= len(list(model.parameters()))
        else:
            assert len(lifted) >= len(list(model.parameters()))
    assert llm.stats()["recompiles"] == 0


def test_unfrozen_weights_edited_in_place_are_seen():
    from kvgraph.presets import load_preset

    model, _ = load_preset("llama-tiny", seed=0)
    llm = LLM(model, page_size=8, max_batch_size=2, max_seq_len=64, freeze_weights=False, progress=False)
    prompt = list(range(5, 25))
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    (before,) = llm.generate([prompt], params)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(0.5)
    (after,) = llm.generate([prompt], params)
    scores = [[p.logprob for p in out.prompt_logprobs[1:]] for out in (before, after)]
    assert scores[0] != scores[1]
    assert llm.stats()["recompiles"] == 0


def test_continuous_cache_from_a_checkpoint_directory(tmp_path, hf_greedy):
    from kvgraph.presets import save_preset

    save_preset("llama-tiny", tmp_path)
    llm = LLM(str(tmp_path), cache_strategy="continuous", max_batch_size=2, max_seq_len=48, compile="eager")
    assert llm.tokenizer is not None
    prompts = ["abc", "a longer prompt", "xyz!"]  # three requests, two slots
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=7, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(llm.model, llm.tokenizer.encode(prompt), 7)
    assert len(llm.manager.slots_remaining) == 2
    stats = llm.stats()
    assert (stats["kv_unit"], stats["kv_unit_tokens"], stats["kv_pages_total"]) == ("slot", 48, 2)
    assert kv_usage_text(stats).startswith("peak 2 of 2 KV slots (48 tokens each, reserved whole: ")


def test_a_preset_name_brings_its_model_and_tokenizer(llama, hf_greedy):
    llm = LLM("llama-tiny", max_batch_size=2, max_seq_len=48, compile="eager")
    (out,) = llm.generate("a text prompt", SamplingParams(max_new_tokens=5, ignore_eos=True))
    model, tokenizer = llama
    assert out.token_ids == hf_greedy(model, tokenizer.encode("a text prompt"), 5)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_rates_leave_out_the_steps_that_compiled(llama):
    model, tokenizer = llama
    llm = LLM(model, tokenizer=tokenizer, max_batch_size=2, max_seq_len=48, compile="eager", progress=False)
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    stats = llm.stats()
    # prefill (T = 3) compiles graph 1, the first decode (T = 1) graph 2; only the last decode is timed
    assert stats["steps"] == 3 and stats["compile_steps"] == 2 and stats["compile_time_s"] > 0
    assert stats["prefill_tokens"] == 3 and stats["prefill_time_s"] == 0 and stats["prefill_tokens_per_s"] == 0
    assert stats["decode_tokens"] == 2 and stats["decode_tokens_per_s"] == 1 / stats["decode_time_s"]
    assert stats["warmup_graphs"] == stats["compiled_graphs"] == 2 and stats["recompiles"] == 0
    llm.warmup()
    assert llm.stats()["compile_steps"] == 0 and llm.stats()["warmup_graphs"] == 2


def test_an_unknown_model_name_lists_the_presets():
    with raises_naming(ConfigError, "model", "'llama-huge'", "preset", "(llama-tiny, "):
        LLM("llama-huge")


class TinyGPT(torch.nn.Module):
    """A module that is not a Hugging Face model: embeddings, causal SDPA blocks, logits."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, max_pos=128):
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_pos, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):
        x = self.tok(input_ids) + self.pos(position_ids)  # x: [1, T, C]
        B, T, C = x.shape
        for qkv, proj in zip(self.qkv, self.proj, strict=True):
            q, k, v = qkv(x).split(C, dim=-1)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(B, T, C))
        return self.head(x)


def test_a_plain_module_matches_its_own_eager_greedy(eager_greedy):
    torch.manual_seed(0)
    model = TinyGPT().eval()
    llm = LLM(model, page_size=4, max_batch_size=4, max_seq_len=64, compile="eager")
    assert (llm.params.num_layers, llm.params.n_kv_heads, llm.params.head_dim) == (2, 4, 8)
    prompts = [[1, 2, 3, 4, 5], [9, 8], [60, 61, 62]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == eager_greedy(model, prompt, 6)
    with raises_naming(RequestError, "text prompt", "'hi'", "tokenizer"):

        llm.generate("hi")


@pytest.mark.parametrize("preset", ["gpt2-tiny", "qwen2-tiny"])
def test_other_presets_match_hf_greedy(preset, hf_greedy):
    from kvgraph.presets import load_preset

    model, tokenizer = load_preset(preset)
    llm = LLM(model, tokenizer=tokenizer, page_size=8, max_batch_size=4, max_seq_len=64, compile="eager")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [100, 3, 7, 200]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=7, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(model, prompt, 7)


def test_after_warmup_no_batch_or_token_count_compiles_a_new_graph(llm):
    assert llm.warmup() > 0
    graphs = llm.stats()["compiled_graphs"]
    assert graphs >= 2  # several tokens per step, and one (T == 1)
    llm.generate([[7] * 20, [8] * 3, [9] * 41, [10]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    llm.generate([[11] * 6], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert llm.stats()["compiled_graphs"] == graphs
    assert llm.stats()["steps"] > 0


def test_seeded_sampling_survives_preemption(llm, shared_prefix_prompts):
    prompts = shared_prefix_prompts(0, [10, 14, 7, 12, 9], seed=5)
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(5)]
    llm.reset_stats()
    together = llm.generate(prompts, params)
    assert llm.stats()["preemptions"] > 0
    for prompt, p, out in zip(prompts, params, together, strict=True):
        (alone,) = llm.generate([prompt], p)
        assert out.token_ids == alone.token_ids


def test_stream_text_adds_up_and_breaking_out_frees_everything(llm):
    pieces, ids = [], []
    for event in llm.stream("stream me", SamplingParams(max_new_tokens=6, ignore_eos=True)):
        pieces.append(event.text)
        ids.append(event.token_id)
    assert event.finish_reason == "length" and len(ids) == 6
    assert "".join(pieces) == llm.tokenizer.decode(ids, skip_special_tokens=True)
    for event in llm.stream(["a", "bb", "ccc"], SamplingParams(max_new_tokens=10)):
        if event.prompt_index == 2:
            break
    assert _all_free(llm)


@pytest.mark.parametrize("dtype, frozen", [(torch.float32, False), (torch.bfloat16, True)])
def test_weights_are_frozen_unless_kvgraph_packs_every_linear(dtype, frozen):
    from kvgraph.presets import load_preset

    model, _ = load_preset("llama-tiny", seed=0)  # LLM casts the module in place
    llm = LLM(model, page_size=8, max_batch_size=2, max_seq_len=32, compile="eager", dtype=dtype, progress=False)
    assert llm.config.freeze_weights is None
    assert llm.compiled.backend.options.freeze_weights is frozen
