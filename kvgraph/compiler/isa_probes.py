"""Inductor's CPU vector-ISA probes, remembered across processes.

Before Inductor compiles its first CPU kernel in a process it checks which vector instruction sets
(AVX2, AVX-512, VNNI, AVX512-BF16, AMX) its C++ kernels may use: for each, a tiny library
compiled once into Inductor's cache, then loaded in a fresh Python subprocess, so that an illegal
instruction kills the child rather than the caller. On a host with AMX that is 5-10 subprocesses
and about 1.9 s of every start (measured on the 2-core Xeon of ``benchmarks/RESULTS.md``,
"Start-up"), the same answer every time.

:func:`remember_isa_probes` keeps each successful load, keyed by the probe library's path, size
and modification time, the CPU's instruction sets and the Python that loaded it, in a file inside
Inductor's cache directory (a fresh cache directory probes afresh). A failed or timed-out probe is
not kept: Inductor asks again next time.

On a fresh cache directory the probes compile each library first: on the 2-core Xeon about 8 s of
C++ compiler time, which Inductor spends the first time it generates a CPU kernel, after Dynamo and
AOTAutograd have traced the graph. :func:`probe_in_background` starts them on a thread when kvgraph
knows Inductor will compile for the CPU, so the compiler runs beside the tracing instead of after it.
The probes run exactly as Inductor runs them (its own ``valid_vec_isa_list``). If Inductor asks
on another thread before they are done, it waits for them (:func:`one_at_a_time`): Inductor's
AVX-512 check adds ``-mavx512bf16`` to the ISA object's flags while it compiles its probe, and
restores them after, so two threads checking at once could leave the flag on for the rest of the
process (measured: one load in ten of ``llama-56m``'s precompiled graphs), and every kernel and
C++ wrapper then compiled again under other flags, that is, another cache key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_NAME = "vec_isa_probes.json"

_lock = threading.Lock()
_probing = threading.RLock()
"""Held while Inductor's ISA list is worked out (:func:`one_at_a_time`)."""
_installed = False
_background: threading.Thread | None = None


def probes_file() -> Path:
    """Where the successful probes are kept: ``<Inductor's cache dir>/kvgraph/vec_isa_probes.json``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kvgraph" / FILE_NAME


def probe_key(library: str) -> str | None:
    """The key of one probe of ``library``: its path, size and modification time, this CPU's
    instruction sets, the Python that loads it; ``None`` if the library is not there."""
    from torch._inductor import cpu_vec_isa

    try:
        stat = os.stat(library)
    except OSError:
        return None
    parts = (library, str(stat.st_size), str(stat.st_mtime_ns), " ".join(sorted(cpu_vec_isa.x86_isa_checker())),
             sys.executable)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _write(path: Path, keys: set[str]) -> None:
    """Write ``keys`` atomically (another process may be writing the same file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(keys)))
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: probing each start is only slower
        logger.info("cannot keep Inductor's ISA probes in %s: %s", path, e)


def remembered(probe):
    """``probe(isa, library) -> bool`` (Inductor's ``VecISA._probe_load``) answered from
    :func:`probes_file` where ``library`` loaded before; a successful new probe is added to it."""

    def remembered_probe(self, output_path: str) -> bool:
        key = probe_key(output_path)
        path = probes_file()
        if key is not None and key in _read(path):
            return True
        ok = probe(self, output_path)
        if ok and key is not None:
            with _lock:
                _write(path, _read(path) | {key})
        return ok

    return remembered_probe


def one_at_a_time(valid_vec_isa_list):
    """Inductor's ``valid_vec_isa_list`` (cached once it has answered) worked out by one thread at
    a time: a caller on another thread waits for the first one's answer (see the module)."""

    @functools.wraps(valid_vec_isa_list)
    def serialized():
        with _probing:
            return valid_vec_isa_list()

    for name in ("cache_clear", "cache_info"):  # functools.cache's, which Inductor's tests call
        if hasattr(valid_vec_isa_list, name):
            setattr(serialized, name, getattr(valid_vec_isa_list, name))
    return serialized


def remember_isa_probes() -> bool:
    """Make Inductor's ISA probe skip the subprocess for a library that loaded in an earlier
    process, and its ISA list be worked out by one thread at a time (see the module).
    Idempotent; returns whether the probe is wrapped (``False`` where this PyTorch has no such
    probe, and then no thread of kvgraph's probes)."""
    global _installed
    from torch._inductor import cpu_vec_isa

    with _lock:
        if not _installed:
            probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
            if probe is None:
                return False
            cpu_vec_isa.VecISA._probe_load = remembered(probe)
            cpu_vec_isa.valid_vec_isa_list = one_at_a_time(cpu_vec_isa.valid_vec_isa_list)
            _installed = True
        return True


def probe_in_background() -> threading.Thread | None:
    """Run Inductor's ISA probes (:func:`torch._inductor.cpu_vec_isa.valid_vec_isa_list`) on a
    daemon thread, once per process; returns that thread, or ``None`` where this PyTorch has no
    probe to wrap or the host is not x86 (other architectures are not probed by compiling)."""
    global _background
    if not remember_isa_probes() or platform.machine() not in ("x86_64", "AMD64"):
        return None
    with _lock:
        if _background is None:
            _background = compiler_thread(_probe_all, "kvgraph-isa-probes")
        return _background


def compiler_thread(target, name: str) -> threading.Thread:
    """A started daemon thread running ``target``, which calls Inductor's C++ compiler: what that
    imports is imported here first, as two threads importing the same modules in opposite orders
    can stop each other (Python then raises in one of them)."""
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.cpp_builder  # noqa: F401
    import torch._inductor.cpu_vec_isa  # noqa: F401
    import torch.utils._filelock  # noqa: F401

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _probe_all() -> None:
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
    except Exception as e:  # Inductor asks again, on its own thread, and raises there if it must
        logger.info("Inductor's ISA probes on a background thread failed: %s: %s", type(e).__name__, e)
