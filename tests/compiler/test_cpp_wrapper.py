"""Inductor's ``cpp_wrapper`` on kvgraph's graphs (``kvgraph.compile(..., cpp_wrapper=True)``, the
default on the CPU): each step matches eager, the graph is called through its C++ entry point, and a
later model loads the precompiled C++ graphs."""

import pytest
import torch
from torch._inductor.codecache import CppWrapperCodeCache

import kvgraph
from kvgraph.compiler.backend import CPP_WRAPPER_ENV, _placeholders_as_dynamos
from tests.compiler.test_precompiled import ONE, _StepLogits, fresh_model
from tests.compiler.toy import decode, manager

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_steps_match_eager_and_a_later_model_loads_the_cpp_graphs(tmp_path, cpp_entries):
    first = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path, cpp_wrapper=True)
    decode(_StepLogits(first), first.manager, prompts=ONE)  # every step checked against eager
    assert first.written_graphs == 1
    assert len(cpp_entries) >= 1  # the graph's wrapper is C++
    cpp_entries.clear()
    second = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path, cpp_wrapper=True)
    decode(_StepLogits(second), second.manager, steps=3, prompts=ONE)
    assert second.loaded_graphs == 1 and len(cpp_entries) >= 1
    # the Python wrapper is keyed apart: nothing of the C++ graphs is loaded for it
    cpp_entries.clear()
    third = kvgraph.compile(fresh_model(), manager=manager(), precompile=tmp_path, cpp_wrapper=False)
    decode(_StepLogits(third), third.manager, prompts=ONE)
    assert third.loaded_graphs == 0 and third.written_graphs == 1 and cpp_entries == []


def test_a_cpp_wrapper_graph_compiles_without_inductors_worker_pool_and_apart_from_its_kernels(monkeypatch):
    """Its kernels are compiled with the wrapper: no pool of worker processes; the wrapper is built
    apart from the kernels (at -O1, they at -O3)."""
    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    asked = []
    warm_pool = async_compile.AsyncCompile.warm_pool.__func__

    def spy(cls):
        asked.append((async_compile.get_compile_threads(), inductor_config.cpp_wrapper_build_separate))
        return warm_pool(cls)

    monkeypatch.setattr(async_compile.AsyncCompile, "warm_pool", classmethod(spy))
    compiled = kvgraph.compile(fresh_model(), manager=manager(), cpp_wrapper=True)
    decode(_StepLogits(compiled), compiled.manager, steps=1, prompts=ONE)
    assert asked and set(asked) == {(1, True)}


def test_the_default_on_the_cpu_is_the_cpp_wrapper(cpp_entries, monkeypatch):
    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)  # the suite's conftest keeps the Python one
    compiled = kvgraph.compile(fresh_model(), manager=manager())
    decode(_StepLogits(compiled), compiled.manager, steps=2, prompts=ONE)
    assert len(cpp_entries) >= 2


def test_kvgraphs_placeholders_keep_their_fake_values_as_dynamo_does():
    """Inductor's ``cpp_wrapper`` takes the inputs from ``meta["val"]`` once one placeholder has it, and
    puts None for the others (Dynamo's, which keep ``example_value``): none may have it."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    (x,) = gm.graph.find_nodes(op="placeholder")
    fake = object()
    x.meta["val"] = fake
    _placeholders_as_dynamos(gm)
    assert "val" not in x.meta and x.meta["example_value"] is fake


@pytest.fixture
def cpp_compile_fails(monkeypatch):
    """Every C++ wrapper fails to build, late in Inductor's compile (where a compiler error would),
    with Inductor's caches off so that nothing built earlier is loaded instead."""
    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)

    def broken(cls, *args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", classmethod(broken))
    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding_async", classmethod(broken))
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


def test_a_default_cpp_wrapper_that_fails_falls_back_to_the_python_one(cpp_compile_fails):
    compiled = kvgraph.compile(fresh_model(), manager=manager())
    with pytest.warns(RuntimeWarning, match=r"C\+\+ wrapper failed.*no C\+\+ compiler here.*Python wrapper"):
        decode(_StepLogits(compiled), compiled.manager, steps=2, prompts=ONE)  # every step checked against eager


def test_a_cpp_wrapper_asked_for_fails_as_it_failed(cpp_compile_fails):
    compiled = kvgraph.compile(fresh_model(), manager=manager(), cpp_wrapper=True)
    with pytest.raises(Exception, match="no C\\+\\+ compiler here"):
        decode(_StepLogits(compiled), compiled.manager, steps=1, prompts=ONE)
