"""Inductor's precompiled C++ headers for the C++ wrapper, built on a thread beside the trace
(``kvgraph.compiler.wrapper_headers``): the ones a graph's compile then asks for, so that it builds
none itself; started by kvgraph's backend for a C++-wrapper CPU graph only."""

import os
import threading

import pytest
import torch
from torch._inductor import codecache
from torch._inductor.utils import fresh_cache

import kvgraph
from kvgraph.compiler import backend, wrapper_headers
from tests.compiler.test_precompiled import ONE, _StepLogits, fresh_model
from tests.compiler.toy import decode, manager

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def header_builds(tmp_path, monkeypatch):
    """Inductor's precompiled headers kept in ``tmp_path``; gives the list of (thread, header) each
    build of a header that was not there yet appends to, the headers asked for, and a function that
    makes Inductor forget the headers it asked for in this process."""
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path))
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(tmp_path / "locks"))
    built, asked = [], []
    compile_cpp, precompile = codecache._worker_compile_cpp, codecache._precompile_header

    def spy_compile(lock_path, builders):
        for builder in builders:
            target = builder.get_target_file_path()
            if target.endswith(".gch") and not os.path.exists(target):
                built.append((threading.current_thread().name, os.path.basename(target)))
        return compile_cpp(lock_path, builders)

    def spy_precompile(header, *args, **kwargs):
        asked.append(header)
        return precompile(header, *args, **kwargs)

    monkeypatch.setattr(codecache, "_worker_compile_cpp", spy_compile)
    monkeypatch.setattr(codecache, "_precompile_header", spy_precompile)
    precompile.cache_clear()  # Inductor remembers each header it asked for in the process
    yield built, asked, precompile.cache_clear
    precompile.cache_clear()  # ...here in tmp_path: asked again, it finds the real ones


@pytest.mark.skipif(not wrapper_headers.enabled(), reason="Inductor does not precompile its headers here")
def test_a_graphs_compile_finds_the_headers_built_ahead(header_builds, tmp_path):
    built, asked, forget = header_builds
    assert wrapper_headers.build_headers()
    assert len(built) == 2  # the wrapper's header and the kernels'
    assert sorted(name for _, name in built) == sorted(p for p in os.listdir(tmp_path) if p.endswith(".gch"))
    built.clear()
    asked.clear()
    # nothing compiled in this process or on disk: the graph is compiled, its module built, and
    # the headers' keys worked out again
    forget()
    with fresh_cache(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(codecache.CppWrapperCodeCache, "cache", {})
        compiled = kvgraph.compile(fresh_model(), manager=manager(), cpp_wrapper=True)
        decode(_StepLogits(compiled), compiled.manager, steps=1, prompts=ONE)
    assert len(set(asked)) == 2  # each graph's compile asked for both headers...
    assert built == []  # ...and built neither


def test_the_backend_starts_it_for_a_cpp_wrapper_cpu_graph_only(monkeypatch):
    started = []
    monkeypatch.setattr(backend, "headers_in_background", lambda: started.append(True))
    compiled = kvgraph.compile(fresh_model(), manager=manager(), cpp_wrapper=False)
    decode(_StepLogits(compiled), compiled.manager, steps=1, prompts=ONE)
    assert started == []
    torch._dynamo.reset()
    compiled = kvgraph.compile(fresh_model(), manager=manager(), cpp_wrapper=True)
    decode(_StepLogits(compiled), compiled.manager, steps=1, prompts=ONE)
    assert started


def test_a_failure_is_logged_and_left_to_inductor(monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise OSError("no compiler")

    monkeypatch.setattr(codecache.CppWrapperCodeCache, "load_async", fail)
    with caplog.at_level("INFO", logger=wrapper_headers.__name__):
        assert wrapper_headers.build_headers() is False
    assert "OSError: no compiler" in caplog.text


def test_nothing_starts_where_inductor_does_not_precompile_headers(monkeypatch):
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(wrapper_headers, "_background", None)
    with inductor_config.patch(cpp_cache_precompile_headers=False):
        assert wrapper_headers.headers_in_background() is None
    assert wrapper_headers._background is None
