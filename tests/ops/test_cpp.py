"""Building and choosing the C++ CPU kernel: KVGRAPH_CPU_ATTENTION, clear errors, the fallback."""

import os
import subprocess
import sys
import time

import pytest
import torch

from kvgraph.ops import cpp
from tests.naming import raises_naming, warns_naming


@pytest.fixture
def fresh_state(monkeypatch):
    """An empty build state for this test (the process's real one is put back afterwards)."""
    monkeypatch.setattr(cpp, "_state", {})


def test_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(cpp.ENV, "fast")
    with raises_naming(cpp.CppKernelError, "KVGRAPH_CPU_ATTENTION", "'fast'", "auto, cpp, sdpa"):
        cpp.choice()


def test_sdpa_choice_never_builds(monkeypatch, fresh_state):
    monkeypatch.setenv(cpp.ENV, "sdpa")
    monkeypatch.setattr(cpp, "build", lambda: pytest.fail("built"))
    assert cpp.available() is False


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpp.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpp, "_pip_ninja_dir", lambda: None)
    with raises_naming(cpp.CppKernelError, "c++", "ninja", "PATH", "g++"):
        cpp.build()


def test_auto_warns_once_and_falls_back(monkeypatch, fresh_state):
    monkeypatch.setenv(cpp.ENV, "auto")

    def fail():
        raise cpp.CppKernelError("no compiler here")

    monkeypatch.setattr(cpp, "build", fail)
    with warns_naming(RuntimeWarning, "no compiler here", "SDPA"):

        assert cpp.available() is False
    assert cpp.available() is False  # decided once: no second warning or build


def test_cpp_choice_raises_when_the_build_fails(monkeypatch, fresh_state):
    monkeypatch.setenv(cpp.ENV, "cpp")

    def fail():
        raise cpp.CppKernelError("no compiler here")

    monkeypatch.setattr(cpp, "build", fail)
    with pytest.raises(cpp.CppKernelError, match="no compiler here"):
        cpp.available()


def test_the_kernel_builds_for_this_cpu_with_the_op_schema():
    cpp.build()
    cpp.build()  # loading again is a no-op
    ours = torch.ops.kvgraph_cpu.ragged_attention.default._schema
    op = torch.ops.kvgraph.ragged_attention.default._schema
    assert [(a.name, str(a.type), a.default_value, a.is_out) for a in ours.arguments] == [
        (a.name, str(a.type), a.default_value, a.is_out) for a in op.arguments
    ]
    assert [a.name for a in ours.arguments[-4:]] == ["scale", "sliding_window", "softcap", "kv_scales"]
    assert ours.arguments[3].alias_info.is_write  # kv_blocks is written in place


@pytest.mark.parametrize("choice", ["sdpa", "cpp"])
def test_the_op_serves_cpu_tensors_with_the_chosen_path(choice):
    """In a fresh process (the choice is made once per process)."""
    code = "from kvgraph.ops.attention import cpu_implementation; print(cpu_implementation())"
    env = {**__import__("os").environ, cpp.ENV: choice}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == choice


def test_the_build_name_is_keyed_by_source_flags_and_torch(monkeypatch, tmp_path):
    flags = ["-O3", "-mavx2"]
    name = cpp.extension_name("AVX2", flags)
    assert name.startswith("kvgraph_cpu_attention_avx2_") and name.isidentifier()
    assert cpp.extension_name("AVX2", list(flags)) == name  # the same build: loaded, not rebuilt
    assert cpp.extension_name("AVX2", ["-O2", "-mavx2"]) != name
    edited = tmp_path / "ragged_attention_cpu.cpp"
    edited.write_bytes(cpp.SOURCE.read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(cpp, "SOURCE", edited)  # one of the sources: the build is keyed by all
    assert cpp.extension_name("AVX2", flags) != name  # another checkout's source: its own build


def test_the_pip_ninja_is_on_path_for_the_build_only(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin")
    with cpp._path_with("/venv/bin"):
        assert os.environ["PATH"].split(os.pathsep) == ["/venv/bin", "/usr/bin"]
    assert os.environ["PATH"] == "/usr/bin"


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    with caplog.at_level("INFO", logger="kvgraph.ops.cpp"):
        cpp._clear_stale_lock(tmp_path)  # another process building now: wait for it
    assert lock.exists() and "waiting for another process" in caplog.text
    old = time.time() - cpp.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger="kvgraph.ops.cpp"):
        cpp._clear_stale_lock(tmp_path)
    assert not lock.exists() and f"removing {lock}" in caplog.text
    cpp._clear_stale_lock(tmp_path)  # no lock: nothing to do
