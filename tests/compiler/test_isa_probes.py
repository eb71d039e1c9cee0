"""Inductor's vector-ISA probes are remembered across processes: a library that loaded once is not
loaded again in a subprocess; a failed probe, a changed library or a fresh cache directory probes again."""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from kvgraph.compiler import isa_probes


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """A probe that records the libraries it loads and answers from ``results`` (default True), wrapped."""
    monkeypatch.setattr(isa_probes, "probes_file", lambda: tmp_path / "cache" / isa_probes.FILE_NAME)
    loaded, results = [], {}

    def probe(isa, library):
        loaded.append(library)
        return results.get(library, True)

    return isa_probes.remembered(probe), loaded, results


def library(tmp_path, name="probe.so", content=b"\x7fELF"):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_a_library_that_loaded_is_not_probed_again(tmp_path, probes):
    probe, loaded, _ = probes
    lib = library(tmp_path)
    assert probe(None, lib) and probe(None, lib)
    assert loaded == [lib]
    assert isa_probes.probes_file().exists()


def test_a_failed_probe_is_asked_again(tmp_path, probes):
    probe, loaded, results = probes
    lib = library(tmp_path)
    results[lib] = False
    assert not probe(None, lib) and not probe(None, lib)
    assert loaded == [lib, lib]


def test_a_changed_library_is_probed_again(tmp_path, probes):
    probe, loaded, _ = probes
    lib = library(tmp_path)
    probe(None, lib)
    stat = os.stat(lib)
    os.utime(lib, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    probe(None, lib)
    assert loaded == [lib, lib]


def test_a_fresh_cache_directory_probes_again(tmp_path, probes, monkeypatch):
    probe, loaded, _ = probes
    lib = library(tmp_path)
    probe(None, lib)
    monkeypatch.setattr(isa_probes, "probes_file", lambda: tmp_path / "fresh" / isa_probes.FILE_NAME)
    probe(None, lib)
    assert loaded == [lib, lib]


def test_a_missing_library_is_probed_and_not_kept(tmp_path, probes):
    probe, loaded, results = probes
    missing = str(tmp_path / "gone.so")
    assert isa_probes.probe_key(missing) is None
    probe(None, missing)
    probe(None, missing)
    assert loaded == [missing, missing]


def test_an_unreadable_probes_file_counts_as_empty(tmp_path, probes):
    probe, loaded, _ = probes
    isa_probes.probes_file().parent.mkdir(parents=True)
    isa_probes.probes_file().write_text("not json")
    lib = library(tmp_path)
    assert probe(None, lib)
    assert loaded == [lib]
    assert probe(None, lib) and loaded == [lib]  # rewritten as valid JSON


def test_the_probe_is_wrapped_once_per_process():
    from torch._inductor import cpu_vec_isa

    assert isa_probes.remember_isa_probes()
    wrapped = cpu_vec_isa.VecISA._probe_load
    assert isa_probes.remember_isa_probes()
    assert cpu_vec_isa.VecISA._probe_load is wrapped


@pytest.fixture
def background(monkeypatch):
    """No probe thread started yet in this process, and Inductor's ISA list replaced by a recorder."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setattr(isa_probes, "_background", None)
    monkeypatch.setattr(isa_probes.platform, "machine", lambda: "x86_64")
    threads = []

    def valid_vec_isa_list():
        threads.append(threading.current_thread())
        return []

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    return threads


def test_the_probes_run_once_on_a_thread_of_their_own(background):
    thread = isa_probes.probe_in_background()
    assert thread is not None and thread.daemon
    assert isa_probes.probe_in_background() is thread
    thread.join(timeout=30)
    assert background == [thread]
    assert thread is not threading.main_thread()


def test_a_failing_background_probe_does_not_raise(monkeypatch, background, caplog):
    from torch._inductor import cpu_vec_isa

    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", broken)
    with caplog.at_level(logging.INFO, logger=isa_probes.__name__):
        isa_probes.probe_in_background().join(timeout=30)
    assert "no compiler" in caplog.text


def test_other_architectures_start_no_probe_thread(monkeypatch, background):
    monkeypatch.setattr(isa_probes.platform, "machine", lambda: "aarch64")
    assert isa_probes.probe_in_background() is None
    assert background == []


@pytest.mark.parametrize("inner, started", [("inductor", True), ("eager", False)])
def test_compiling_for_inductor_on_the_cpu_starts_the_probes(monkeypatch, inner, started):
    import torch

    import kvgraph
    from kvgraph.compiler import backend

    calls = []
    monkeypatch.setattr(backend, "probe_in_background", lambda: calls.append(1))
    kvgraph.compile(torch.nn.Linear(4, 4), inner=inner)
    assert bool(calls) == started


def test_the_isa_list_is_worked_out_by_one_thread_at_a_time():
    calls, inside, most = [], [0], [0]

    def slow():
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        inside[0] -= 1
        calls.append(threading.current_thread())
        return ["isa"]

    serialized = isa_probes.one_at_a_time(slow)
    threads = [threading.Thread(target=serialized) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] == 1 and len(calls) == 3
    assert serialized() == ["isa"]


# Inductor's AVX-512 check, on two threads at once (the probes' thread and a load of precompiled
# graphs), each with a slow compile: without kvgraph's lock the bf16 flag it adds while it checks
# stays on the VNNI ISA for good, and every kernel compiles under another cache key.
_RACE = """
import threading, time
import torch
from torch._inductor import config, cpu_vec_isa
from kvgraph.compiler import isa_probes

assert isa_probes.remember_isa_probes()
config.cpp.vec_isa_ok = None
cpu_vec_isa.x86_isa_checker = lambda: ["avx2", "avx512", "avx512_vnni"]
torch.cpu._is_avx512_bf16_supported = lambda: True
torch.cpu._is_vnni_supported = lambda: True
cpu_vec_isa.VecISA.check_build = lambda self, code: time.sleep(0.3) or True
threads = [threading.Thread(target=cpu_vec_isa.valid_vec_isa_list) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
vnni = cpu_vec_isa.pick_vec_isa()
print(str(vnni), "|", vnni.build_arch_flags())
"""


def test_two_threads_asking_for_the_isa_leave_its_flags_as_they_were():
    out = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": ""})
    assert out.returncode == 0, out.stderr
    name, flags = out.stdout.strip().rsplit("\n", 1)[-1].split(" | ")
    assert name == "avx512 avx512_vnni"
    assert "-mavx512vnni" in flags and "bf16" not in flags
