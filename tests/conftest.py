"""Suite-wide set-up: without CUDA, Triton kernels run in Triton's interpreter on CPU tensors;
every test starts from the same random state, so a model built with random weights is the same
model whatever ran before it; graphs get Inductor's Python wrapper unless a test asks for C++.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported, so it is set here,
before any test module can import one.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's Python wrapper unless a test asks for C++ (tests/compiler/test_cpp_wrapper.py,
# tests/engine/test_cpp_wrapper_default.py): each C++ wrapper is a compile of seconds, and the
# suite compiles hundreds of small models.
os.environ.setdefault("KVGRAPH_CPP_WRAPPER", "0")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def graph_threads(monkeypatch) -> list[int]:
    """The intra-op thread count at each call of a lowered, compiled graph, in call order."""
    from kvgraph.compiler import backend, precompiled

    seen: list[int] = []
    call, run = backend.LoweredGraph.__call__, precompiled.SerializableRunner.run

    def spy_call(self, args, kv):
        seen.append(torch.get_num_threads())
        return call(self, args, kv)

    def spy_run(self, args, kv):  # a graph of a precompiled model
        seen.append(torch.get_num_threads())
        return run(self, args, kv)

    monkeypatch.setattr(backend.LoweredGraph, "__call__", spy_call)
    monkeypatch.setattr(precompiled.SerializableRunner, "run", spy_run)
    return seen


@pytest.fixture
def cpp_entries(monkeypatch) -> list:
    """The C++ wrappers Inductor's generated modules load (``CppWrapperCodeCache.load_pybinding``)."""
    from torch._inductor.codecache import CppWrapperCodeCache

    loaded = []
    original = CppWrapperCodeCache.load_pybinding.__func__

    def load_pybinding(cls, *args, **kwargs):
        loaded.append(args)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", classmethod(load_pybinding))
    return loaded
