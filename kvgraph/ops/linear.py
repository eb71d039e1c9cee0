"""``kvgraph::linear``: the output projection with a weight packed once for oneDNN on the CPU.

``torch.ops.kvgraph.linear(x [..., C], weight [V, C], bias [V] | None) -> [..., V]`` is
``F.linear``. On the CPU, for float32, it runs oneDNN's linear on a copy of
``weight`` packed into oneDNN's blocked layout, made once per weight and made again when the
weight changes in place (its version counter moves). The pruned vocabulary projection of a
decode step is a skinny GEMM (a few dozen rows against tens of thousands of columns) where
this is about twice as fast as the MKL GEMM behind ``F.linear`` on this project's CPUs
(``benchmarks/linear.py``). Inductor packs linears like this only for static batch sizes.
Other devices and dtypes run ``F.linear``.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

MAX_PACKED_ROWS = 256  # past this (a prefill-sized GEMM) MKL's F.linear is as fast or faster
PACKED_DTYPES = (torch.float32,)  # oneDNN's bf16 linear needs AVX512-BF16 or AMX

_LIB = torch.library.Library("kvgraph", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")

_lock = threading.Lock()
_ATTR = "_kvgraph_onednn_packed"  # on the weight tensor: (its version when packed, the packed copy)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [V, C]`` in oneDNN's layout, packed on first use and again after an in-place change.

    The packed copy hangs on the weight tensor itself, so it lives and dies with it. An inference
    tensor has no version counter (``torch.inference_mode`` made it): it is packed once.
    """
    version = None if weight.is_inference() else weight._version
    entry = getattr(weight, _ATTR, None)
    if entry is None or entry[0] != version:
        with _lock:
            entry = getattr(weight, _ATTR, None)
            if entry is None or entry[0] != version:
                entry = (version, weight.detach().to_mkldnn())
                setattr(weight, _ATTR, entry)
    return entry[1]


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes the packed oneDNN path for these tensors."""
    return (
        torch.backends.mkldnn.is_available() and x.device.type == "cpu" and weight.dim() == 2
        and x.dtype == weight.dtype and weight.dtype in PACKED_DTYPES and not torch.is_grad_enabled()
    )


@torch.library.impl(_LIB, "linear", "CPU")
def _linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [N, C]
    if rows.shape[0] > MAX_PACKED_ROWS or not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed_weight(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


@torch.library.impl(_LIB, "linear", "CompositeExplicitAutograd")
def _linear_default(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@torch.library.register_fake("kvgraph::linear", lib=_LIB)
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., C], weight [V, C], bias [V])``, packed for oneDNN on the CPU (see the module)."""
    return torch.ops.kvgraph.linear(x, weight, bias)
