"""Build and load kvgraph's C++ CPU kernels: ``kvgraph::ragged_attention``
(``csrc/ragged_attention_cpu.cpp``), the fused int8 weight-only linear layer of
``kvgraph::int8_weight_linear`` and its one-row VNNI kernel (``csrc/int8_linear_cpu.cpp``),
``kvgraph::linear``'s packed float32 path (``csrc/packed_linear_cpu.cpp``, ``csrc/panel_gemm_cpu.cpp``)
and the sampler's greedy pick (``csrc/greedy_cpu.cpp``), one library.

The library is compiled on first use with :func:`torch.utils.cpp_extension.load` (the C++
compiler Inductor needs too, with ``ninja``), for the SIMD level PyTorch itself runs on this CPU
(``torch.backends.cpu.get_cpu_capability()``), and cached in PyTorch's extension directory
(``TORCH_EXTENSIONS_DIR``) under a name keyed by the source, flags and torch install
(:func:`extension_name`), so later processes load it in well under a second.

``KVGRAPH_CPU_ATTENTION`` chooses the CPU implementation:

- ``auto`` (default): the C++ kernel; if it cannot be built, one warning that says why and how to
  fix it, then the SDPA path (:mod:`kvgraph.ops.cpu`).
- ``cpp``: the C++ kernel; a failed build raises :class:`CppKernelError`.
- ``sdpa``: the SDPA path, no compiler needed.
- ``reference``: the pure-PyTorch reference (:mod:`kvgraph.ops.reference`), the slowest and simplest.

A decode step over an int8 cache reads the int8 rows in place, with AVX-512 VNNI where the CPU has
it, else with AVX2 and FMA; other steps and caches dequantize rows into a tile buffer.
``KVGRAPH_INT8_DECODE`` (read at every call) picks a slower path: ``auto`` (default), ``avx2`` (never
VNNI) or ``tiles`` (the tile buffer), to compare them or to test each on one CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from kvgraph.errors import CacheInputError, CppKernelError
from kvgraph.ops.checks import attention_fake
from kvgraph.ops.fake_linear import linear_fake
from kvgraph.ops.plan import StepPlan, with_op_arguments
from kvgraph.ops.schema import SCHEMA, AttentionArgs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "ragged_attention_cpu.cpp"
INT8_SOURCE = Path(__file__).parent / "csrc" / "int8_linear_cpu.cpp"
PACKED_LINEAR_SOURCE = Path(__file__).parent / "csrc" / "packed_linear_cpu.cpp"
PANEL_GEMM_SOURCE = Path(__file__).parent / "csrc" / "panel_gemm_cpu.cpp"
GREEDY_SOURCE = Path(__file__).parent / "csrc" / "greedy_cpu.cpp"
PACK_ARENA_SOURCE = Path(__file__).parent / "csrc" / "pack_arena.cpp"
HEADERS = (Path(__file__).parent / "csrc" / "panel_gemm.h", Path(__file__).parent / "csrc" / "pack_arena.h",
           Path(__file__).parent / "csrc" / "int8_parts.h",
           Path(__file__).parent / "csrc" / "int8_decode_avx2.h",
           Path(__file__).parent / "csrc" / "prefill_tiles_avx2.h")  # part of the build's key, not compiled alone
PACKED_LINEAR_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias, int max_packed_rows, int pack_rows) -> Tensor"
INT8_SCHEMA = "(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor"
INT8_ROUTED_SCHEMA = ("(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int fused_min_rows, int fused_max_rows, "
                      "int matvec_rows, int vnni_rows, Tensor? act_scales=None) -> Tensor")
STALE_LOCK_SECONDS = 600  # a build here takes 1-3 minutes: a lock this old was left by a killed build
ENV = "KVGRAPH_CPU_ATTENTION"
CHOICES = ("auto", "cpp", "sdpa", "reference")
# SIMD flags per PyTorch CPU capability; ATen's vectorized types follow CPU_CAPABILITY_*.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}


_lock = threading.Lock()
_state: dict[str, object] = {}
_library: torch.library.Library | None = None


def choice() -> str:
    """The implementation ``KVGRAPH_CPU_ATTENTION`` asks for; ``CppKernelError`` for an unknown value."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise CppKernelError(f"{ENV}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def capability() -> str:
    """The SIMD level the kernel is built for: PyTorch's own on this CPU (``AVX2``, ``AVX512``, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def build() -> None:
    """Compile (or load from the cache) the kernel and register ``torch.ops.kvgraph_cpu.ragged_attention``.

    Raises ``CppKernelError`` with the reason: no C++ compiler, no ninja, or the compiler's error.
    """
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if "c++" in missing and shutil.which(os.environ.get("CXX", "g++")) is not None:
        missing.remove("c++")
    ninja_dir = _pip_ninja_dir() if "ninja" in missing else None
    if ninja_dir is not None:
        missing.remove("ninja")
    if missing:
        raise CppKernelError(
            f"cannot build the C++ CPU attention kernel: {' and '.join(missing)} not found on PATH "
            "(install a C++ compiler, e.g. `apt-get install g++`, and `pip install ninja`)"
        )
    from torch.utils import cpp_extension

    _define_schema()
    level = capability()
    flags = ["-O3", "-fopenmp", "-std=c++17", *CAPABILITY_FLAGS.get(level, [])]
    name = extension_name(level, flags)
    _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    try:
        with _path_with(ninja_dir):
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in sources()],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # the compiler's or loader's message, whatever its type
        names = ", ".join(source.name for source in sources())
        raise CppKernelError(f"building kvgraph's C++ CPU kernels ({names}, {level}) failed: {e}") from e


def _clear_stale_lock(build_dir: Path) -> None:
    """Remove the build lock a killed build left in ``build_dir``: ``cpp_extension.load`` waits for
    a lock to go away, forever. A lock younger than :data:`STALE_LOCK_SECONDS` is another process's
    build, which this one waits for (said once in the log)."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age < STALE_LOCK_SECONDS:
        logger.info("waiting for another process's build of the C++ kernels (%s, %.0f s old)", lock, age)
        return
    logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()


def sources() -> tuple[Path, ...]:
    """The library's C++ sources: the attention kernel, the int8 linear layer, the packed float32
    one, its GEMM and the arena its packs live in, and the greedy pick."""
    return SOURCE, INT8_SOURCE, PACKED_LINEAR_SOURCE, PANEL_GEMM_SOURCE, PACK_ARENA_SOURCE, GREEDY_SOURCE


def _define_schema() -> None:
    """Define ``kvgraph_cpu::ragged_attention`` with the op's own :data:`~kvgraph.ops.schema.SCHEMA`
    (once per process); the C++ library registers only its CPU implementation of it."""
    global _library
    if _library is None:
        library = torch.library.Library("kvgraph_cpu", "DEF")
        library.define("ragged_attention" + SCHEMA)
        torch.library.register_fake("kvgraph_cpu::ragged_attention", attention_fake, lib=library)
        library.define("int8_linear_bf16" + INT8_SCHEMA)
        library.define("int8_matvec" + INT8_SCHEMA)
        library.define("int8_weight_linear" + INT8_ROUTED_SCHEMA)
        torch.library.register_fake("kvgraph_cpu::int8_weight_linear", linear_fake, lib=library)
        library.define("packed_linear" + PACKED_LINEAR_SCHEMA)
        torch.library.register_fake("kvgraph_cpu::packed_linear", linear_fake, lib=library)
        library.define("packed_linear_gemm() -> str")
        library.define("pack_arena_zeros(int[] sizes) -> Tensor")
        library.define("argmax_rows(Tensor logits) -> Tensor")
        _library = library


def extension_name(level: str, flags: list[str]) -> str:
    """``kvgraph_cpu_attention_<level>_<key>``: the build's name in PyTorch's extension directory,
    keyed by what the library depends on (the source, the flags, and the torch it links against).

    The directory is shared by every checkout and environment of the user; under one name, two
    checkouts or two torch installs would rewrite each other's build and recompile it at every
    start. Keyed, each distinct build is compiled once and every later process only loads it."""
    key = hashlib.blake2b(digest_size=6)
    for part in (*(source.read_bytes() for source in (*sources(), *HEADERS)), " ".join(flags).encode(), torch.__version__.encode(),
                 os.path.dirname(torch.__file__).encode()):
        key.update(part)
        key.update(b"\0")
    return f"kvgraph_cpu_attention_{level.lower()}_{key.hexdigest()}"


def _pip_ninja_dir() -> str | None:
    """The directory of the ``ninja`` of the ``ninja`` pip package (a dependency of kvgraph), or
    ``None``: an un-activated virtualenv's ``bin`` is not on ``PATH``, where
    ``torch.utils.cpp_extension`` looks for it."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = os.path.dirname(sys.executable)
    return bin_dir if os.path.exists(os.path.join(bin_dir, "ninja")) else None


@contextlib.contextmanager
def _path_with(directory: str | None) -> Iterator[None]:
    """``directory`` first on ``PATH`` for the duration of the block (the build), then ``PATH`` as it was."""
    if directory is None:
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = directory + os.pathsep + (before or "")
    try:
        yield
    finally:
        if before is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = before


def available() -> bool:
    """Whether the C++ kernel is to be used: built and loaded once per process, as :func:`choice` says.

    With ``auto``, a failed build warns once and returns ``False`` (the SDPA path runs);
    with ``cpp`` it raises ``CppKernelError``; with ``sdpa`` or ``reference`` it is ``False`` without building.
    """
    wanted = choice()
    if wanted in ("sdpa", "reference"):
        return False
    error = _load()
    if error is not None and wanted == "cpp":
        raise CppKernelError(str(error))
    if error is not None and not _state.get("warned"):
        _state["warned"] = True
        message = f"{error}; kvgraph falls back to the slower SDPA attention path on the CPU"
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return error is None


def _load() -> CppKernelError | None:
    """Build and load the library once per process (one attempt, also when it fails): the build's error or ``None``."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    build()
                    _state["ok"] = True
                except CppKernelError as e:
                    _state["ok"], _state["error"] = False, e
    return _state.get("error")


def _kernel():
    """``torch.ops.kvgraph_cpu.ragged_attention.default``, built and loaded once per process."""
    error = _load()
    if error is not None:
        raise CppKernelError(str(error))
    return torch.ops.kvgraph_cpu.ragged_attention.default


def direct_kernel() -> torch._ops.OpOverload:
    """``torch.ops.kvgraph_cpu.ragged_attention.default`` for a graph to call in place of the op
    (:mod:`kvgraph.compiler.direct_kernels`): built and loaded, with the op's fake implementation."""
    return _kernel()


def int8_kernel():
    """``torch.ops.kvgraph_cpu.int8_linear_bf16.default`` (built with the attention kernel on first
    use, whatever ``KVGRAPH_CPU_ATTENTION`` chooses), or ``None`` if the library cannot be built:
    ``kvgraph::int8_weight_linear`` then runs without it (the reason is logged once)."""
    error = _load()
    if error is not None:
        if not _state.get("int8_logged"):
            _state["int8_logged"] = True
            logger.info("%s; kvgraph::int8_weight_linear runs without its fused kernel", error)
        return None
    return torch.ops.kvgraph_cpu.int8_linear_bf16.default


def packed_linear_kernel():
    """``torch.ops.kvgraph_cpu.packed_linear.default`` (``kvgraph::linear``'s float32 path with the
    pack kept in C++), or ``None`` where the library cannot be built or has no packed GEMM for this
    CPU (neither AVX2, oneDNN nor MKL)."""
    if _load() is not None or torch.ops.kvgraph_cpu.packed_linear_gemm() == "none":
        return None
    return torch.ops.kvgraph_cpu.packed_linear.default


def argmax_kernel():
    """``torch.ops.kvgraph_cpu.argmax_rows.default`` (each row's first largest float32 logit, as
    ``torch.max(dim=-1).indices``), or ``None`` where the library cannot be built."""
    if _load() is not None:
        return None
    return torch.ops.kvgraph_cpu.argmax_rows.default


def packed_linear_gemm() -> str | None:
    """What ``kvgraph_cpu::packed_linear`` multiplies a weight packed now with: ``"panels"``
    (kvgraph's GEMM, ``csrc/panel_gemm_cpu.cpp``: AVX-512 builds, and AVX2 builds on a CPU not made
    by Intel), ``"onednn"`` (oneDNN's packed linear: builds without AVX2 on such a CPU), ``"mkl"``
    (MKL's packed GEMM: Intel CPUs without AVX-512) or ``"none"``
    (``F.linear``), or what ``KVGRAPH_PACKED_GEMM`` picks (``ValueError`` for one this build and CPU
    lack); ``None`` where the library cannot be built."""
    if _load() is not None:
        return None
    return torch.ops.kvgraph_cpu.packed_linear_gemm()


def run(args: AttentionArgs, plan: StepPlan) -> torch.Tensor:
    """The op on CPU tensors through the C++ kernel, on arguments checked against ``plan``.

    The C++ kernel checks the index values and raises ``CacheInputError`` (as ``ValueError``)
    before anything is written. Builds the kernel on first use. Arguments and shapes are
    :class:`~kvgraph.ops.schema.AttentionArgs`'; ``kv_blocks`` must be contiguous.

    Returns:
        ``[T, Hq, D]`` in q's dtype, accumulated in float32 (float64 for float64 inputs).
    """
    kernel = _kernel()
    try:
        return kernel(*args)
    except ValueError as e:
        raise CacheInputError(str(e)) from None


ragged_attention = with_op_arguments(run)
