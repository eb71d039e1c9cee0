"""Inductor's precompiled C++ headers for a graph's C++ wrapper, built beside the trace.

With its wrapper in C++ on the CPU, Inductor compiles a graph as two translation units, the wrapper
and the kernels (``cpp_wrapper_build_separate``, as kvgraph sets it), and before compiling them it
precompiles the header each one includes (``torch/csrc/inductor/cpp_wrapper/cpu.h`` and
``torch/csrc/inductor/cpp_prefix.h``) into ``precompiled_headers`` under
``<temp dir>/torchinductor_<user>``, a directory that ``TORCHINDUCTOR_CACHE_DIR`` does not move.
Each took about 8 s of compiler time on the 2-core Zen 3 of ``benchmarks/RESULTS.md``, one after
the other, after Dynamo, AOTAutograd and Inductor's code generation had run: once per user, temp
directory, PyTorch and compiler, so a process compiling its first graph there spends about 17 s
on them.

:func:`headers_in_background` asks Inductor for the same two headers on a daemon thread as soon as
kvgraph's backend is handed a CPU graph to compile, so the compiler runs beside the tracing on the
other core. It goes through Inductor's own ``CppWrapperCodeCache.load_async`` with a module of
one line that is never compiled: the headers' command lines and cache keys are Inductor's own, and
when the graph's compile reaches them it waits on their file lock for a build under way, then
finds them. Where they exist already the thread costs two runs of the preprocessor (about 0.3 s
each). Any failure is logged and left to Inductor, which builds the headers itself as before.
"""

from __future__ import annotations

import itertools
import logging
import platform
import threading

from kvgraph.compiler.isa_probes import compiler_thread

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_background: threading.Thread | None = None

# A wrapper and a kernel translation unit of one line each: only their headers are built. Inductor
# keeps the modules it was asked for by their code, and asks for headers for a new one only: each
# call's module says its number.
_MAIN = "// kvgraph: Inductor's C++ wrapper header, precompiled ahead of a graph's compile ({})\n"
_KERNELS = "// kvgraph: Inductor's C++ kernel header, precompiled ahead of a graph's compile ({})\n"
_calls = itertools.count()


def enabled() -> bool:
    """Whether Inductor precompiles its C++ headers here (its ``cpp_cache_precompile_headers``;
    never on Windows)."""
    import torch._inductor.config as inductor_config

    return bool(getattr(inductor_config, "cpp_cache_precompile_headers", False)) and platform.system() != "Windows"


def headers_in_background() -> threading.Thread | None:
    """Build Inductor's two C++ wrapper-mode headers on a daemon thread, once per process (see the
    module); returns that thread, or ``None`` where Inductor does not precompile headers."""
    global _background
    if not enabled():
        return None
    with _lock:
        if _background is None:
            _background = compiler_thread(build_headers, "kvgraph-wrapper-headers")
        return _background


def build_headers() -> bool:
    """Have Inductor build (or find) the precompiled headers of a C++-wrapper graph on the CPU whose
    wrapper and kernels compile apart, the kernels vectorized; whether it did without an error."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codecache import CppWrapperCodeCache

        cpu_vec_isa.valid_vec_isa_list()  # the kernels' header needs the ISA: after the probes, not beside them
        call = next(_calls)
        CppWrapperCodeCache.load_async(_MAIN.format(call), "cpu", optimized_code=_KERNELS.format(call),
                                       needs_vec_isa=False, kernel_needs_vec_isa=True)
        return True
    except Exception as e:  # Inductor builds them itself when the graph compiles
        logger.info("Inductor's C++ headers on a background thread failed: %s: %s", type(e).__name__, e)
        return False
