"""``kvgraph::int8_weight_linear``: a linear layer over an int8 weight with one scale per output row.

``torch.ops.kvgraph.int8_weight_linear(x [..., K], weight int8 [N, K], scales [N], bias [N] | None)
-> [..., N]`` is ``(x @ weight.T) * scales + bias`` in ``x``'s dtype; the product is what ATen's
``_weight_int8pack_mm`` computes.
That kernel reads one byte per weight but multiplies a row at a time: on an AVX-512/AMX host it
is faster than dequantizing up to ~24 rows (3-5x at 1 row), 1.3x slower at 32 rows, 2.2x at 64
and ~10x at 2048 (``benchmarks/int8_linear.py``). So the op routes by the row count of the call:

- at most :data:`MATVEC_ROWS` rows (a small decode batch, bandwidth-bound): ATen's int8 kernel;
- more rows: the weight dequantized to ``x``'s dtype (int8 times its row's scale, rounded once,
  as torchao's own dequantization), then one GEMM (oneDNN, AMX in bfloat16). The
  dequantized copy lives for the call only, so the model keeps its int8 footprint.

:func:`kvgraph.engine.quantization.quantize` gives every quantized linear layer this op, so the
compiled graph calls it as it is (Inductor runs it as an extern kernel) and the choice is made
at each call, where the step's row count is known.
"""

from __future__ import annotations

import torch

MATVEC_ROWS = 24  # up to here ATen's int8 matrix-vector kernel wins (bf16, 1408 x 512: 16 rows 0.17 vs
# 0.22 ms, 32 rows 0.32 vs 0.25 ms; benchmarks/int8_linear.py)

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
    # int8 -> x's dtype is exact; times the row's scale, rounded once (as torchao's dequantize)
    return torch.mm(x2d, weight.to(x2d.dtype).mul_(scales.to(x2d.dtype)[:, None]).t())


def _finish(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out.add_(bias.to(out.dtype))
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.impl(_LIB, "int8_weight_linear", "CPU")
def _int8_weight_linear_cpu(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, weight, scales, bias)
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] <= MATVEC_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(x2d.contiguous(), weight, scales.to(x.dtype))
    else:
        out = _dequantized_product(x2d, weight, scales)
    return _finish(out, x, weight, bias)


@torch.library.impl(_LIB, "int8_weight_linear", "CompositeExplicitAutograd")
def _int8_weight_linear_default(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, weight, scales, bias)
    return _finish(_dequantized_product(x.reshape(-1, x.shape[-1]), weight, scales), x, weight, bias)


@torch.library.register_fake("kvgraph::int8_weight_linear", lib=_LIB)
def _int8_weight_linear_fake(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x @ weight.T) * scales + bias`` for an int8 ``weight [N, K]`` (see the module)."""
    return torch.ops.kvgraph.int8_weight_linear(x, weight, scales, bias)
