"""Compiled models kept whole on disk (``kvgraph.compile(..., precompile=dir)``): written by the first
model, loaded by a later one without tracing, keyed by what they depend on, set aside when damaged."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import kvgraph
from kvgraph.compiler.precompiled import SHAPE_CLASSES, precompile_key
from kvgraph.compiler.runtime import intra_op_threads
from kvgraph.errors import ConfigError
from tests.compiler.toy import ToyDecoder, decode, manager, params

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIONS = {"inner": "inductor", "prune_logits": True, "freeze_weights": False, "windows": None,
           "packed_linears": True, "cpp_wrapper": False}


def fresh_model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ToyDecoder().eval()


ONE = [[5, 9, 2, 7, 1]]
"""One sequence: its prefill is a step of several tokens and its decodes steps of one."""


def test_a_second_model_loads_the_graph_of_every_step_without_tracing(tmp_path):
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    assert first.one_graph and first.shape_classes == SHAPE_CLASSES[:1]
    decode(first, first.manager, prompts=ONE)  # prefill (T > 1), decodes (T == 1): checked against eager
    assert first.loaded_graphs == 0 and first.written_graphs == 1
    assert [p.name.split("-", 1)[1] for p in tmp_path.glob("*.bin")] == [f"{SHAPE_CLASSES[0]}.bin"]
    traced = counters["kvgraph"]["graphs"]
    assert traced == 1  # the decodes ran on the prefill's graph: no graph specialised to T == 1

    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    decode(second, second.manager, steps=3, prompts=ONE)
    decode(second, second.manager)  # three sequences: T == 3 in the same graph
    assert second.loaded_graphs == 1
    assert counters["kvgraph"]["graphs"] == traced  # Dynamo handed the backend no graph: nothing traced


def test_a_first_step_of_one_token_compiles_the_graph_of_every_step(tmp_path):
    """Shown two tokens for its guards and capture, never run on them."""
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    decode(first, first.manager, steps=3, prompts=[[7]])  # T == 1 from the first step
    decode(first, first.manager)  # then steps of several tokens on the same graph
    assert first.written_graphs == 1 and counters["kvgraph"]["graphs"] == 1
    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    steps = _StepLogits(second)  # the engine's calls: the graph's arguments gathered directly once checked
    decode(steps, second.manager, steps=2, prompts=[[7]])  # a T == 1 call passes the loaded graph's guards
    decode(steps, second.manager)  # T = 6 after T = 1: the token count told from constants
    assert second.loaded_graphs == 1 and second.written_graphs == 0
    assert second._direct["tokens"].direct and second._direct["tokens"].refused is None


def test_steps_of_one_token_can_keep_a_graph_of_their_own(tmp_path):
    """``one_graph = False`` before the first call: Dynamo's graph specialised to T == 1, a second file."""
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    first.one_graph = False
    decode(first, first.manager, prompts=ONE)
    assert first.written_graphs == 2 and counters["kvgraph"]["graphs"] == 2
    assert sorted(p.name.split("-", 1)[1] for p in tmp_path.glob("*.bin")) == sorted(f"{c}.bin" for c in SHAPE_CLASSES)
    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    second.one_graph = False
    decode(second, second.manager, steps=3, prompts=ONE)
    assert second.loaded_graphs == 2 and counters["kvgraph"]["graphs"] == 2
    assert second.precompiled(True) and second.precompiled(False)  # each class its own loaded graph


class _StepLogits:
    """A compiled model's ``logits`` (what the engine's steps call) where ``decode`` calls the model."""

    def __init__(self, compiled) -> None:
        self.compiled, self.model = compiled, compiled.model

    def __call__(self, **kwargs):
        return self.compiled.logits(**kwargs)


class _Refuses:
    def __call__(self, *args, **kwargs):
        raise AssertionError("the bytecode ran after the graph went direct")


def test_steps_call_the_loaded_graphs_directly_once_their_arguments_are_checked(tmp_path):
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    decode(first, first.manager, prompts=ONE)
    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    steps = _StepLogits(second)
    decode(steps, second.manager, steps=3, prompts=[[2, 7]])  # T = 2, then three steps of T = 1: checked against eager
    assert second.loaded_graphs == 1 and list(second._direct) == ["tokens"]
    direct = second._direct["tokens"]
    assert direct.direct and direct.refused is None  # T = 1 after T = 2: its sizes are told from constants
    decode(steps, second.manager)  # T = 6, then T = 3
    for direct in second._direct.values():
        direct.compiled = _Refuses()
    for seq in range(second.manager.max_batch_size):
        second.manager.release(seq)
    decode(steps, second.manager, steps=3, prompts=[[3, 1, 4, 1], [5, 9]])  # T = 6, then T = 2
    decode(steps, second.manager, steps=2, prompts=ONE)  # T = 5, then T = 1


def test_the_key_follows_the_model_the_cache_layout_and_the_options():
    model = fresh_model()
    key = precompile_key(model, params(), OPTIONS)
    assert precompile_key(fresh_model(), params(), OPTIONS) == key  # same structure, same settings
    other_weights = fresh_model()
    with torch.no_grad():
        other_weights.head.weight.add_(1.0)  # weights are graph inputs: the same compiled graph serves them
    assert precompile_key(other_weights, params(), OPTIONS) == key
    assert precompile_key(model, params(page_size=8), OPTIONS) != key
    assert precompile_key(model, params(strategy="continuous"), OPTIONS) != key
    assert precompile_key(model, params(), {**OPTIONS, "prune_logits": False}) != key
    assert precompile_key(model.double(), params(), OPTIONS) != key
    wider = fresh_model()
    wider.head = torch.nn.Linear(32, 61, bias=False)
    assert precompile_key(wider, params(), OPTIONS) != key


def test_the_key_follows_kvgraphs_settings_but_not_how_memory_is_mapped(monkeypatch):
    model = fresh_model()
    key = precompile_key(model, params(), OPTIONS)
    monkeypatch.setenv("KVGRAPH_POOL_POPULATE", "eager")
    monkeypatch.setenv("KVGRAPH_HUGE_PAGES", "0")
    assert precompile_key(model, params(), OPTIONS) == key
    monkeypatch.setenv("KVGRAPH_CPU_ATTENTION", "sdpa")  # a setting the lowered graph may follow
    assert precompile_key(model, params(), OPTIONS) != key


def test_a_damaged_file_is_set_aside_with_a_warning_and_written_again(tmp_path):
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    decode(first, first.manager, prompts=ONE)
    tokens_file = first.precompile.path(SHAPE_CLASSES[0])
    tokens_file.write_bytes(b"not a compiled graph")

    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    with pytest.warns(RuntimeWarning, match="set aside the precompiled tokens graph"):
        decode(second, second.manager, prompts=ONE)
    assert second.loaded_graphs == 0 and second.written_graphs == 1
    assert tokens_file.stat().st_size > 1000  # compiled afresh and written again

    third = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    decode(third, third.manager, prompts=ONE)
    assert third.loaded_graphs == 1


def test_a_graph_whose_guards_refuse_the_call_is_compiled_afresh(tmp_path):
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    first.one_graph = False  # writes a graph specialised to T == 1 too
    decode(first, first.manager, prompts=ONE)
    store = first.precompile
    # The one-token graph, in the several-token graph's place: its guards want T == 1.
    store.path(SHAPE_CLASSES[0]).write_bytes(store.path(SHAPE_CLASSES[1]).read_bytes())

    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
    with pytest.warns(RuntimeWarning, match="its guards refuse this call"):
        decode(second, second.manager, steps=1, prompts=[[4]])  # T == 1 first: shown two tokens, refused
    assert second.loaded_graphs == 0 and second.written_graphs == 1


@pytest.mark.parametrize("written, read", [(2, 1), (1, 2)])
def test_a_graph_captured_on_one_thread_count_loads_on_another(tmp_path, written, read, recwarn):
    """Dynamo's guards hold the thread count, the compiled kernels do not depend on it: the file is
    loaded, not set aside (``kvgraph serve``'s engine runs on a core fewer than ``generate``)."""
    with intra_op_threads(written):
        first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
        decode(first, first.manager, prompts=ONE)
    assert first.written_graphs == 1
    with intra_op_threads(read):
        second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path)
        decode(second, second.manager, steps=3, prompts=ONE)  # checked against eager
        assert torch.get_num_threads() == read  # the guards' count only while they are checked
    assert second.loaded_graphs == 1 and second.written_graphs == 0
    assert not [w for w in recwarn if "set aside" in str(w.message)]


def test_precompile_needs_a_manager_inductor_and_unfrozen_weights(tmp_path):
    with pytest.raises(ConfigError, match="precompile needs a manager"):
        kvgraph.compile(fresh_model(), precompile=tmp_path)
    with pytest.raises(ConfigError, match="freeze_weights=True"):
        kvgraph.compile(fresh_model(), manager=manager(), freeze_weights=True, precompile=tmp_path)
    with pytest.raises(ConfigError, match="inner='eager'"):
        kvgraph.compile(fresh_model(), manager=manager(), inner="eager", precompile=tmp_path)


SCRIPT = textwrap.dedent("""
    import json, sys
    from kvgraph import LLM, EngineConfig, SamplingParams
    from kvgraph.presets import load_preset

    model, tokenizer = load_preset("llama-tiny", seed=0)
    llm = LLM(model, tokenizer=tokenizer, config=EngineConfig(progress=False, max_seq_len=64, max_batch_size=4))
    llm.warmup()
    out = llm.generate([[1, 2, 3, 4, 5], [7]], SamplingParams(max_new_tokens=6))
    print(json.dumps({"tokens": [c.token_ids for c in out], "note": llm.startup_note(),
                      "recompiles": llm.stats()["recompiles"]}))
""")


def test_a_second_engine_process_starts_from_the_files_of_the_first(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def start():
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["note"] == "1 graph compiled and written to precompiled files"
    assert second["note"].startswith("1 graph loaded whole from precompiled files")
    assert second["tokens"] == first["tokens"]
    assert first["recompiles"] == second["recompiles"] == 0
    assert len(list((tmp_path / "kvgraph" / "precompiled").glob("*.bin"))) == 1
