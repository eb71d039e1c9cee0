"""Quantized KV cache storage (MAX's ``KVCacheQuantizationConfig``): 8-bit K/V with a float32 scale
per group of ``quantization_granularity`` elements of the head dimension.

A quantized cache keeps two tensors: ``kv_blocks`` in the 8-bit storage dtype (``params.dtype``,
``torch.int8`` or ``torch.float8_e4m3fn``) and ``kv_scales``, laid out like ``kv_blocks`` with the
last dim ``head_dim // group`` (paged ``[total_num_pages, 2, L, page_size, Hkv, D // group]``).
Element ``d`` of a row is ``blocks[..., d] * scales[..., d // group]``.

Symmetric, per group: ``scale = max|x| / QMAX`` (``QMAX`` 127 for int8, 448 for float8_e4m3fn),
``q = round(x * (1 / scale))`` (a group of zeros has scale 0 and stores zeros). Every
implementation (the reference here, the C++ kernel) computes exactly this in float32, so they store
the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraph.errors import InvalidParamsError

QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Largest magnitude each 8-bit storage dtype holds: a group's ``max|x|`` maps onto it."""
STORAGE_DTYPES = tuple(QMAX)
"""The dtypes a quantized cache stores K/V in."""
SCALE_DTYPES = (torch.float32,)
"""The dtypes of the scales (MAX's ``scale_dtype``)."""


@dataclass(frozen=True)
class KVCacheQuantizationConfig:
    """How a quantized cache is scaled (as MAX's).

    Attributes:
        scale_dtype: dtype of the scales; ``torch.float32`` is the one supported.
        quantization_granularity: elements of the head dimension that share one scale; clamped to
            ``head_dim`` (``KVCacheParams.scale_group``), which it must then divide.
    """

    scale_dtype: torch.dtype = torch.float32
    quantization_granularity: int = 128

    def __post_init__(self) -> None:
        if self.scale_dtype not in SCALE_DTYPES:
            raise InvalidParamsError(
                f"scale_dtype {self.scale_dtype!r} is not supported; supported: {list(SCALE_DTYPES)}"
            )
        g = self.quantization_granularity
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
            raise InvalidParamsError(f"quantization_granularity must be a positive int, got {g!r}")

    def group(self, head_dim: int) -> int:
        """Elements per scale for ``head_dim``: the granularity clamped to ``head_dim``; it must divide it."""
        group = min(self.quantization_granularity, head_dim)
        if head_dim % group:
            raise InvalidParamsError(
                f"quantization_granularity={self.quantization_granularity} does not divide head_dim={head_dim}"
            )
        return group


def check_storage(dtype: torch.dtype, config: KVCacheQuantizationConfig | None) -> None:
    """``InvalidParamsError`` unless ``(dtype, config)`` is a supported pair: a floating cache
    without a config, or an 8-bit storage dtype (``STORAGE_DTYPES``) with one."""
    if config is None:
        if dtype in STORAGE_DTYPES:
            raise InvalidParamsError(
                f"dtype {dtype} stores a quantized cache: it needs kvcache_quant_config=KVCacheQuantizationConfig()"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidParamsError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        return
    if not isinstance(config, KVCacheQuantizationConfig):
        raise InvalidParamsError(f"kvcache_quant_config must be a KVCacheQuantizationConfig, got {config!r}")
    if dtype not in STORAGE_DTYPES:
        raise InvalidParamsError(
            f"kvcache_quant_config needs an 8-bit storage dtype, one of {list(STORAGE_DTYPES)}; got dtype {dtype!r} "
            f"(scale_dtype {config.scale_dtype})"
        )


def scales_shape_problem(blocks_shape: tuple, scales_shape: tuple) -> str | None:
    """Why ``kv_scales`` of ``scales_shape`` cannot hold the scales of ``kv_blocks`` of ``blocks_shape``
    (``kv_blocks``' shape but the last dim, and a last dim dividing head_dim), or ``None`` if it can.

    The one shape rule of the scales, for the collection, the runtime's binding and the op's plan,
    each of which raises its own error type with this text. Symbolic sizes (while tracing) are not
    compared, so that the check adds no guards.
    """

    def differ(a, b) -> bool:
        return isinstance(a, int) and isinstance(b, int) and a != b

    if len(scales_shape) != 6 or len(blocks_shape) != 6 or any(map(differ, scales_shape[:5], blocks_shape[:5])):
        return (f"kv_scales shape {tuple(scales_shape)} must be kv_blocks' {tuple(blocks_shape[:5])} "
                f"with a last dim of scales")
    groups, head_dim = scales_shape[5], blocks_shape[5]
    if isinstance(groups, int) and isinstance(head_dim, int) and (groups < 1 or head_dim % groups):
        return f"kv_scales has {groups} scales per row, which does not divide head_dim {head_dim}"
    return None


def quantize(x: torch.Tensor, dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (floating) as ``(q [..., D] dtype, scales [..., D // group] float32)``."""
    xg = x.float().unflatten(-1, (-1, group))  # [..., D // group, group]
    amax = xg.abs().amax(-1)
    # Divided by a tensor, not a Python number: CUDA computes ``tensor / number`` as ``tensor * (1 /
    # number)``, a bit off IEEE division in some cases, while the kernels (C++, Triton) divide.
    scales = amax / torch.full_like(amax, QMAX[dtype])
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    y = xg * inv[..., None]
    if dtype == torch.int8:
        y = torch.round(y)
    y = y.clamp(-QMAX[dtype], QMAX[dtype])
    return y.to(dtype).flatten(-2), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., D]`` (8-bit) times ``scales [..., D // group]`` (float32), computed in float32, as ``dtype``."""
    groups = scales.shape[-1]
    out = q.float().unflatten(-1, (groups, -1)) * scales[..., None]
    return out.flatten(-2).to(dtype)
