"""``kvgraph::int8_weight_linear``: a linear layer over an int8 weight with one scale per output row.

``torch.ops.kvgraph.int8_weight_linear(x [..., K], weight int8 [N, K], scales [N], bias [N] | None)
-> [..., N]`` is ``(x @ weight.T) * scales + bias`` in ``x``'s dtype; the product is what ATen's
``_weight_int8pack_mm`` computes.
That kernel reads one byte per weight but multiplies a row at a time: on an AVX-512/AMX host it
is 3-10x faster than dequantizing the weight at 1 row, 1.3x slower at 32 rows, 2.2x at 64 and
~10x at 2048 (``benchmarks/int8_linear.py``). So the op routes by the row count of the call:

- one row (batch-1 decode, bound by weight reads), bfloat16 or float32 activations, a CPU with
  AVX-512 VNNI: kvgraph's ``int8_matvec`` (``csrc/int8_linear_cpu.cpp``): the row split into three
  int8 parts (exact to float32), each 64 weights multiplied by VPDPBUSD as they are loaded, the next
  rows prefetched; it read ``llama-56m``'s 57 layers at 26 GB/s where ATen's kernel read them at 20;
- up to :data:`FUSED_MIN_ROWS` - 1 rows: ATen's kernel;
- :data:`FUSED_MIN_ROWS` .. :data:`FUSED_MAX_ROWS` rows (a decode batch), bfloat16 activations,
  an AVX-512 CPU: kvgraph's fused kernel (``csrc/int8_linear_cpu.cpp``): 64 weight rows at a
  time converted to bfloat16 in the core's cache and multiplied by oneDNN's brgemm microkernel
  (AMX where present), each weight read once as one byte; 2.5-5x faster than ATen's kernel at
  16-64 rows. Without it (no C++ compiler, another CPU, float32), up to :data:`MATVEC_ROWS` rows
  go to ATen's kernel;
- more rows (a prefill): the weight dequantized to ``x``'s dtype (int8 times its row's scale,
  rounded once, as torchao's own dequantization), then one GEMM (oneDNN, AMX in bfloat16). The
  dequantized copy lives for the call only, so the model keeps its int8 footprint.

:func:`kvgraph.engine.quantization.quantize` gives every quantized linear layer this routing, so
the compiled graph calls it as it is (Inductor runs it as an extern kernel) and the choice is made
at each call, where the step's row count is known. Where kvgraph's C++ library is built, the
layers call ``kvgraph_cpu::int8_weight_linear`` (:func:`int8_weight_linear` with :func:`cpu_routes`),
the same routing in C++, so no Python runs between the graph and the kernels (13 us a call here,
a decode step's 57 calls 0.7 ms); ``torch.ops.kvgraph.int8_weight_linear`` stays the op's
definition, for every device and for callers without the library.
"""

from __future__ import annotations

import logging

import torch

from kvgraph.ops import cpp
from kvgraph.ops.fake_linear import linear_fake

logger = logging.getLogger(__name__)

FUSED_MIN_ROWS = 9  # below, ATen's int8 kernel is as fast as the fused one (1408 x 512: 8 rows 0.098 vs 0.092 ms)
FUSED_MAX_ROWS = 64  # the fused kernel's limit: one microkernel per row count up to here
MATVEC_ROWS = 48  # without the fused kernel, ATen's int8 kernel up to here (bf16, 1408 x 512: 32 rows 0.32 vs
# 0.44 ms dequantizing, 64 rows 0.64 vs 0.51 ms; benchmarks/int8_linear.py)

_LIB = torch.library.Library("kvgraph", "FRAGMENT")
_LIB.define("int8_weight_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor")


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"int8_weight_linear: weight must be a 2-D int8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"int8_weight_linear: x's last dim {x.shape[-1]} is not the weight's K = {weight.shape[1]}")
    if scales.shape != (weight.shape[0],):
        raise ValueError(f"int8_weight_linear: scales must have shape ({weight.shape[0]},), got {tuple(scales.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"int8_weight_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _dequantized_product(x2d: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # int8 times the row's float32 scale, rounded once to x's dtype: torchao's own dequantization
    dequantized = weight.to(torch.float32).mul_(scales.float()[:, None]).to(x2d.dtype)
    return torch.mm(x2d, dequantized.t())


def _finish(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out.add_(bias.to(out.dtype))
    return out.view(*x.shape[:-1], weight.shape[0])


VNNI_ROWS = 1  # kvgraph's int8_matvec up to here (at 2 rows and more ATen's kernel was as fast)

_fused_state: dict[str, object] = {}


def fused_kernel():
    """``torch.ops.kvgraph_cpu.int8_linear_bf16.default`` where it runs (kvgraph's C++ library
    built for AVX-512, and its product checked once against the dequantized one), else ``None``."""
    if "kernel" not in _fused_state:
        kernel = cpp.int8_kernel() if cpp.capability() == "AVX512" else None
        if kernel is not None and not _agrees(kernel, rows=FUSED_MIN_ROWS, dtype=torch.bfloat16,
                                              name="fused int8 linear kernel"):
            kernel = None
        _fused_state["kernel"] = kernel
    return _fused_state["kernel"]


def _agrees(kernel, rows: int, dtype: torch.dtype, name: str) -> bool:
    """Whether ``kernel`` runs on this CPU and gives the dequantized product (to bf16 rounding) at ``rows`` rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 32, generator=g).to(dtype)
    weight = torch.randint(-127, 128, (70, 32), dtype=torch.int8, generator=g)
    scales = torch.rand(70, generator=g) / 127
    try:
        got = kernel(x, weight, scales, None).float()
    except RuntimeError as e:  # oneDNN has no bfloat16 microkernel for this CPU, or it has no VNNI
        logger.warning("kvgraph's %s does not run here (%s); ATen's kernels serve instead", name, e)
        return False
    want = x.double() @ (weight.double() * scales.double()[:, None]).T
    if torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2 * max(want.abs().max().item(), 1.0)):
        return True
    logger.warning("kvgraph's %s disagrees with the dequantized product; ATen's kernels serve instead", name)
    return False


def matvec_kernel():
    """``torch.ops.kvgraph_cpu.int8_matvec.default`` where it runs (kvgraph's C++ library built for
    AVX-512 on a CPU with VNNI, and its product checked once against the dequantized one), else ``None``."""
    if "matvec" not in _fused_state:
        kernel = None
        if cpp.int8_kernel() is not None and cpp.capability() == "AVX512":
            kernel = torch.ops.kvgraph_cpu.int8_matvec.default
            if not _agrees(kernel, rows=1, dtype=torch.float32, name="int8 matvec kernel"):
                kernel = None
        _fused_state["matvec"] = kernel
    return _fused_state["matvec"]


def kernel_for(rows: int, dtype: torch.dtype, k: int) -> str:
    """Which kernel the op runs on the CPU for ``rows`` rows of ``dtype`` activations with ``k``
    input features: ``"matvec"`` (``int8_matvec``), ``"fused"``, ``"aten"``
    (``_weight_int8pack_mm``) or ``"dequantize"`` (a GEMM over the weight dequantized for the call)."""
    if 1 <= rows <= VNNI_ROWS and dtype in (torch.bfloat16, torch.float32) and matvec_kernel() is not None:
        return "matvec"
    if FUSED_MIN_ROWS <= rows <= FUSED_MAX_ROWS and dtype is torch.bfloat16 and k % 2 == 0:
        if fused_kernel() is not None:
            return "fused"
    return "aten" if rows <= MATVEC_ROWS else "dequantize"


def cpu_routes() -> tuple[int, int, int, int] | None:
    """``(fused_min_rows, fused_max_rows, matvec_rows, vnni_rows)`` for ``kvgraph_cpu::int8_weight_linear``
    on this host (the fused range empty where :func:`fused_kernel` does not run, ``vnni_rows`` 0 where
    :func:`matvec_kernel` does not), or ``None`` where kvgraph's C++ library cannot be built. Builds
    and loads it on first use."""
    if cpp.int8_kernel() is None:
        return None
    vnni_rows = VNNI_ROWS if matvec_kernel() is not None else 0
    if fused_kernel() is None:
        return (1, 0, MATVEC_ROWS, vnni_rows)
    return (FUSED_MIN_ROWS, FUSED_MAX_ROWS, MATVEC_ROWS, vnni_rows)


@torch.library.impl(_LIB, "int8_weight_linear", "CPU")
def _int8_weight_linear_cpu(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    # every quantized linear of every step: few Python calls on the way to the kernel
    _check(x, weight, scales, bias)
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    kernel = kernel_for(x2d.shape[0], x.dtype, k)
    if kernel == "matvec":
        out = matvec_kernel()(x2d, weight.contiguous(), scales.float().contiguous(),
                              None if bias is None else bias.float().contiguous())
        return out.view(*x.shape[:-1], weight.shape[0])
    if kernel == "fused":
        if scales.dtype is not torch.float32 or not weight.is_contiguous():
            weight, scales = weight.contiguous(), scales.float().contiguous()
        if bias is not None and bias.dtype is not torch.bfloat16:
            bias = bias.to(torch.bfloat16)
        out = fused_kernel()(x2d.contiguous(), weight, scales, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    if kernel == "aten":
        out = torch.ops.aten._weight_int8pack_mm(x2d.contiguous(), weight, scales.to(x.dtype))
    else:
        out = _dequantized_product(x2d, weight, scales)
    return _finish(out, x, weight, bias)


@torch.library.impl(_LIB, "int8_weight_linear", "CompositeExplicitAutograd")
def _int8_weight_linear_default(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, weight, scales, bias)
    return _finish(_dequantized_product(x.reshape(-1, x.shape[-1]), weight, scales), x, weight, bias)


torch.library.register_fake("kvgraph::int8_weight_linear", linear_fake, lib=_LIB)


def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, routes: tuple[int, int, int, int] | None = None,
                       act_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ weight.T) * scales + bias`` for an int8 ``weight [N, K]`` (see the module): on the CPU
    with ``routes`` (:func:`cpu_routes`), through ``kvgraph_cpu::int8_weight_linear`` (which takes
    ``act_scales``, ``scales`` already in ``x``'s dtype, for ATen's kernel), else through
    ``kvgraph::int8_weight_linear``."""
    if routes is not None and x.device.type == "cpu":
        return torch.ops.kvgraph_cpu.int8_weight_linear(x, weight, scales, bias, *routes, act_scales)
    return torch.ops.kvgraph.int8_weight_linear(x, weight, scales, bias)
