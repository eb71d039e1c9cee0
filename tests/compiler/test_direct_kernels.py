"""A compiled CPU graph calls the C++ attention kernel directly when it serves the op, keeps
``kvgraph::ragged_attention`` otherwise, and the kernel's errors still arrive typed."""

import contextlib

import pytest
import torch

import kvgraph
from kvgraph.compiler.direct_kernels import typed_kernel_errors
from kvgraph.errors import CacheInputError
from kvgraph.ops import attention, cpp
from tests.compiler.toy import decode, manager

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def cpu_attention(monkeypatch):
    """``cpu_attention(choice)``: the CPU implementation chosen afresh from ``KVGRAPH_CPU_ATTENTION``."""

    def choose(choice: str) -> str:
        monkeypatch.setenv(cpp.ENV, choice)
        monkeypatch.setattr(attention, "_cpu_run", None)
        return attention.cpu_implementation()

    return choose


def attention_calls(compiled, mgr, ops=("kvgraph::ragged_attention", "kvgraph_cpu::ragged_attention")) -> dict[str, int]:
    """Calls of the ops (by default the attention op and its C++ kernel) in one more decode step."""
    with torch.profiler.profile() as prof:
        decode(compiled, mgr, steps=0, prompts=[[4, 2]])
    names = [e.name for e in prof.events()]
    return {name: names.count(name) for name in ops}


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_the_graph_calls_the_cpp_kernel_directly(model, cpu_attention, inner):
    if cpu_attention("auto") != "cpp":
        pytest.skip("the C++ kernel does not build here")
    mgr = manager()
    compiled = kvgraph.compile(model, manager=mgr, inner=inner)
    decode(compiled, mgr, steps=2)  # every step checked against the eager model
    assert attention_calls(compiled, mgr) == {"kvgraph::ragged_attention": 0, "kvgraph_cpu::ragged_attention": 2}
    # the lowered graph itself (what ``kvgraph dump`` shows) keeps the op: a copy was redirected
    (lowered,) = compiled.backend.runners[0].layouts.values()
    op = torch.ops.kvgraph.ragged_attention.default
    assert len(lowered.result.gm.graph.find_nodes(op="call_function", target=op)) == 2


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_the_graph_calls_the_packed_linear_kernel_directly(model, inner):
    if cpp.packed_linear_kernel() is None:
        pytest.skip("kvgraph's C++ library does not build here, or PyTorch has no MKL")
    mgr = manager()
    compiled = kvgraph.compile(model, manager=mgr, inner=inner)
    decode(compiled, mgr, steps=2)  # every step checked against the eager model
    (lowered,) = compiled.backend.runners[0].layouts.values()
    linears = len(lowered.result.gm.graph.find_nodes(op="call_function", target=torch.ops.kvgraph.linear.default))
    assert linears > 0  # the lowered graph itself keeps the op
    calls = attention_calls(compiled, mgr, ("kvgraph::linear", "kvgraph_cpu::packed_linear"))
    assert calls == {"kvgraph::linear": 0, "kvgraph_cpu::packed_linear": linears}


def test_other_cpu_implementations_keep_the_op(model, cpu_attention):
    assert cpu_attention("sdpa") == "sdpa"
    mgr = manager()
    compiled = kvgraph.compile(model, manager=mgr, inner="eager")
    decode(compiled, mgr, steps=1)
    assert attention_calls(compiled, mgr) == {"kvgraph::ragged_attention": 2, "kvgraph_cpu::ragged_attention": 0}


def test_the_kernels_value_errors_arrive_as_cache_input_errors():
    with pytest.raises(CacheInputError, match="cache_lengths must be >= 0"), typed_kernel_errors():
        raise ValueError("cache_lengths must be >= 0, got [-1]")
    with pytest.raises(CacheInputError, match="already typed"), typed_kernel_errors():
        raise CacheInputError("already typed")
    with pytest.raises(TypeError), typed_kernel_errors():
        raise TypeError("not the kernel's")


def test_the_size_asserts_inductor_leaves_out_would_pass(model, monkeypatch):
    """kvgraph compiles without Inductor's size and alignment asserts: with them on, every input and
    every extern kernel's output (the C++ attention and linear kernels here) matches what the graph
    was compiled for, at every step."""
    from kvgraph.compiler import backend

    if cpp.packed_linear_kernel() is None or attention.cpu_implementation() != "cpp":
        pytest.skip("kvgraph's C++ library does not build here")
    kvgraph_config = backend._inductor_config

    def with_asserts(options, device):
        stack = contextlib.ExitStack()
        stack.enter_context(kvgraph_config(options, device))
        # compiled afresh: a cached graph would carry the asserts of the fakes it was compiled with
        stack.enter_context(torch._inductor.config.patch(size_asserts=True, alignment_asserts=True,
                                                         force_disable_caches=True))
        return stack

    monkeypatch.setattr(backend, "_inductor_config", with_asserts)
    mgr = manager()
    compiled = kvgraph.compile(model, manager=mgr, inner="inductor")
    decode(compiled, mgr, steps=2)
    calls = attention_calls(compiled, mgr, ("kvgraph_cpu::packed_linear", "kvgraph_cpu::ragged_attention"))
    assert min(calls.values()) > 0
