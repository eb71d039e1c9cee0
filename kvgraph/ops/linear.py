"""``kvgraph::linear``: a linear layer whose weight is packed once for the CPU's GEMM.

``torch.ops.kvgraph.linear(x [..., C], weight [V, C], bias [V] | None) -> [..., V]`` is
``F.linear``. On the CPU, for float32, it multiplies by a copy of ``weight`` packed once (and
again when the weight changes in place: its version counter moves):

- with kvgraph's C++ library (:mod:`kvgraph.ops.cpp`) built for AVX-512: the weight packed
  into panels of 32 columns and multiplied by kvgraph's own GEMM (``csrc/panel_gemm_cpu.cpp``),
  which prefetches each panel's successor while it multiplies: a decode step's linear layers of
  ``llama-56m`` run 1.3-1.5x faster than MKL's packed GEMM at 8-16 rows, 1.1-1.3x at 32, and
  within 10% of it at 1 and at 64-512 rows (``benchmarks/linear.py --model llama-56m``). The op and the graphs
  kvgraph compiles (:mod:`kvgraph.compiler.direct_kernels`) both call
  ``kvgraph_cpu::packed_linear``, which keeps the pack in C++;
- with that library built for AVX2, on a CPU not made by Intel: the same panels (16 columns,
  blocks of 6 rows), with x packed for the caches from 16 rows (a prompt, or a decode step of 16
  sequences or more; 0.76-0.90x the time of x read in place at 16-128 rows). On a 2-core Zen 3 EPYC
  a step's linear layers of ``llama-56m`` took 0.51-0.58x the time of oneDNN's packed product at
  1-16 rows, 0.77x at 32-64 and 0.87x at 96, and 0.81-0.96x that of oneDNN's product with the plain
  weight (``mkldnn._linear_pointwise``) at 96-2048 rows; oneDNN was in turn 1.6-2x faster than
  MKL's packed GEMM there, which does not run its fast code on AMD CPUs. ``KVGRAPH_PACKED_GEMM`` (``auto``, ``panels``, ``onednn``, ``mkl``; read when a weight is
  packed) picks another product the build and CPU have: ``onednn`` is oneDNN's blocked layout for
  :data:`PACK_ROWS` rows (``mkldnn._reorder_linear_weight``);
- without that library, or with it on an Intel CPU without AVX-512, with MKL (PyTorch's x86
  builds): MKL's packed SGEMM (``cblas_sgemm_pack`` /
  ``cblas_sgemm_compute``, through ``torch.ops.mkl``), packed for :data:`PACK_ROWS` rows. At
  the row counts of a decode step (1..64) a step's linear layers run 1.3-1.6x faster than with
  ``F.linear`` or oneDNN's packed linear on an Intel Xeon, and about as fast up to :data:`MAX_PACKED_ROWS`
  (``benchmarks/linear.py``). PyTorch itself uses the packed product only for the row count it
  packed for; MKL's packed B serves any row count, which :func:`packed_weight` checks once per
  weight against ``F.linear`` (and uses oneDNN for that weight if it ever did not).
- without MKL: oneDNN's blocked layout (``mkldnn._linear_pointwise``).

Inductor packs linear layers only for static row counts (MKL) or through oneDNN (dynamic ones);
kvgraph's token count is dynamic, so the lowering hands every float32 CPU linear to this op
(:mod:`kvgraph.passes.packed_linears`). Other devices and dtypes, and more rows than
:func:`max_packed_rows`, run ``F.linear``.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from kvgraph.ops.fake_linear import linear_fake

MAX_PACKED_ROWS = 512  # past this (a prefill-sized GEMM) F.linear is as fast on an Intel CPU
NO_ROW_LIMIT = 1 << 62  # the panel GEMM on other CPUs: every row count (see max_packed_rows)
PACK_ROWS = 64  # MKL packs for this many rows: the best layout for decode batches of 1..64
PACKED_DTYPES = (torch.float32,)  # oneDNN's bf16 linear needs AVX512-BF16 or AMX
CHECK_ROWS = 3  # rows of the one-off comparison of a new MKL pack with F.linear

logger = logging.getLogger(__name__)

_LIB = torch.library.Library("kvgraph", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")

_lock = threading.Lock()
_ATTR = "_kvgraph_packed"  # on the weight tensor: (its version when packed, kind, the packed copy)


def has_mkl() -> bool:
    """Whether this PyTorch build has MKL's packed SGEMM (``torch.ops.mkl._mkl_linear``)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


_MKL_LINEAR = torch.ops.mkl._mkl_linear.default if has_mkl() else None
_CAN_PACK = has_mkl() or torch.backends.mkldnn.is_available()


def packed_weight(weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``("mkl" | "onednn", weight [V, C] packed)``: packed on first use and again after an in-place change.

    The packed copy hangs on the weight tensor itself, so it lives and dies with it. An inference
    tensor has no version counter (``torch.inference_mode`` made it): it is packed once.
    """
    version = None if weight.is_inference() else weight._version
    entry = getattr(weight, _ATTR, None)
    if entry is None or entry[0] != version:
        with _lock:
            entry = getattr(weight, _ATTR, None)
            if entry is None or entry[0] != version:
                entry = (version, *_pack(weight.detach()))
                setattr(weight, _ATTR, entry)
    return entry[1], entry[2]


def _pack(weight: torch.Tensor) -> tuple[str, torch.Tensor]:
    weight = weight.contiguous()
    if _MKL_LINEAR is not None:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS)
        if _mkl_pack_agrees(weight, packed):
            return "mkl", packed
        logger.warning(
            "MKL's product with a weight of shape %s packed for %d rows differs from F.linear at %d rows; "
            "this weight uses oneDNN instead", tuple(weight.shape), PACK_ROWS, CHECK_ROWS,
        )
    return "onednn", weight.to_mkldnn()


def _mkl_pack_agrees(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether MKL's product with ``packed`` at :data:`CHECK_ROWS` rows (not the rows it was packed
    for) equals ``F.linear``'s, to float32 rounding."""
    x = torch.randn(CHECK_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
    got = _MKL_LINEAR(x, packed, weight, None, CHECK_ROWS)
    want = F.linear(x, weight)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * max(want.abs().max().item(), 1.0)))


def uses_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes a packed path for these tensors (at most :data:`MAX_PACKED_ROWS` rows)."""
    return (
        x.dtype is weight.dtype and weight.dtype in PACKED_DTYPES and weight.dim() == 2
        and not torch.is_grad_enabled() and _CAN_PACK and x.device.type == "cpu"
    )


def cpuinfo(field: str) -> str | None:
    """The first CPU's ``field`` in ``/proc/cpuinfo`` (``"vendor_id"``, ``"model name"``, ...);
    ``None`` where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == field:  # the whole name: "model" is not "model name"
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str | None:
    """The CPU's ``vendor_id`` (``"GenuineIntel"``, ``"AuthenticAMD"``, ...); ``None`` where unknown."""
    return cpuinfo("vendor_id")


_max_rows: int | None = None


def max_packed_rows() -> int:
    """The most rows ``kvgraph_cpu::packed_linear`` multiplies itself; past them it calls ``F.linear``.

    :data:`MAX_PACKED_ROWS` (512) for MKL's packed GEMM, and for kvgraph's panel GEMM on an Intel
    CPU: there ``F.linear`` (MKL's own GEMM) is as fast past 512 rows (a 2-core Xeon). On any other
    CPU the panel GEMM takes every row count: on a 2-core AMD EPYC (Zen 4), where MKL does not run its
    AVX-512 code, it multiplied ``llama-56m``'s 57 linear layers 1.12-1.25x faster than ``F.linear``
    at 512-2048 rows (183-188 against 146-166 GFLOP/s; ``benchmarks/linear.py --model llama-56m``),
    and ``mixed`` ran 1.03x faster end to end. (An AVX2 build blocks x for the caches past 128
    rows: on a Zen 3 0.81-0.96x the time of oneDNN's product with the plain weight at 96-2048 rows.) Decided
    once per process."""
    global _max_rows
    if _max_rows is None:
        from kvgraph.ops import cpp

        panels = cpp.packed_linear_gemm() == "panels"
        _max_rows = NO_ROW_LIMIT if panels and cpu_vendor() not in (None, "GenuineIntel") else MAX_PACKED_ROWS
    return _max_rows


_CPP_UNKNOWN = object()
_cpp_linear: object = _CPP_UNKNOWN  # kvgraph_cpu::packed_linear, None without kvgraph's C++ library


def cpp_kernel():
    """``torch.ops.kvgraph_cpu.packed_linear.default``, the op's float32 CPU path with the pack kept
    in C++, or ``None`` where kvgraph's C++ library does not build or has no packed GEMM for this
    CPU. Looked up once per process; the first call builds the library if nothing has yet."""
    global _cpp_linear
    if _cpp_linear is _CPP_UNKNOWN:
        from kvgraph.ops import cpp  # the library's build: on first use, not at import

        _cpp_linear = cpp.packed_linear_kernel()
    return _cpp_linear


@torch.library.impl(_LIB, "linear", "CPU")
def _linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    kernel = cpp_kernel()
    if kernel is not None:
        return kernel(x, weight, bias, max_packed_rows(), PACK_ROWS)
    return python_linear(x, weight, bias)


def python_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op's CPU path without kvgraph's C++ library: MKL's pack, else oneDNN's, kept on the weight."""
    # a hot path where the library is missing: few checks, no reshapes for MKL
    n = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if n == 0 or n > MAX_PACKED_ROWS or not uses_packed(x, weight):
        return F.linear(x, weight, bias)
    kind, packed = packed_weight(weight)
    if kind == "mkl":
        # the row count is passed as the packed one: MKL's packed B serves any (checked at pack time)
        return _MKL_LINEAR(x, packed, weight, bias, n)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(n, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.impl(_LIB, "linear", "CompositeExplicitAutograd")
def _linear_default(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


torch.library.register_fake("kvgraph::linear", linear_fake, lib=_LIB)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., C], weight [V, C], bias [V])`` with a packed weight on the CPU (see the module)."""
    return torch.ops.kvgraph.linear(x, weight, bias)
