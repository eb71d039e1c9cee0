"""``@triton.jit`` helpers of the quantized cache (:mod:`kvgraph.cache.quant`'s format and rounding).

A quantized cache stores K/V as int8 (``QUANT == 1``) or float8_e4m3fn (``QUANT == 2``) with a
float32 scale per ``QGROUP`` elements of the head dimension, in a scales tensor laid out like the
cache with ``HEAD_DIM // QGROUP`` values per row. ``QUANT == 0`` is a floating cache.

- :func:`quantize_rows` quantizes a tile of new rows exactly as :func:`kvgraph.cache.quant.quantize`
  does, so the kernels store the bytes the reference and the C++ kernel store: ``scale = max|x| /
  QMAX`` and ``1 / scale`` with IEEE division (``div_rn``), ``x * (1 / scale)`` rounded to nearest
  even. The rounding adds and subtracts 1.5 * 2**23, which is exact only if the product is not
  fused into that add: the store kernel is launched with ``enable_fp_fusion=False``. float8 values
  are rounded to e4m3's grid here, so the final conversion is exact (Triton's interpreter rounds
  values across a power of two wrongly), and a zero keeps its sign bit as torch's conversion keeps it
  (an H100's conversion of -0.0 stores +0).

Reads (:func:`kvgraph.ops.triton.tile_kernel.attend_tile`) dequantize in registers: with one scale
per row the 8-bit values go to the dot as they are and the scale weighs the row's score and
probability; with finer groups each loaded tile becomes fp32 values times their scales, in the
queries' dtype.
"""

import triton
import triton.language as tl

ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + ROUNDER - ROUNDER is x rounded to nearest even, |x| < 2**22


@triton.jit
def round_even(x):
    """fp32 ``x`` rounded to the nearest integer, ties to even (``torch.round``), for ``|x| < 2**22``."""
    return (x + ROUNDER) - ROUNDER


@triton.jit
def round_e4m3(y):
    """fp32 ``y`` in ``[-448, 448]`` rounded to the nearest float8_e4m3fn value, ties to even, as fp32
    (the sign of a zero kept, as torch's conversion keeps it)."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2**-6, e4m3's subnormals share one quantum
    quantum = ((127 + e - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2**(e - 3)
    inv_quantum = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
    t = round_even(tl.abs(y) * inv_quantum) * quantum  # powers of two: both products are exact
    return tl.where(y < 0, -t, t)


@triton.jit
def quantize_rows(x, d_valid, QUANT: tl.constexpr, QMAX: tl.constexpr, QGROUP: tl.constexpr,
                  GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr):
    """Quantize ``x`` ``[R, HEAD_DIM_PAD]`` (fp32) per group of ``QGROUP`` elements of the head dim
    (``d_valid [HEAD_DIM_PAD]`` marks its columns; ``GROUPS`` groups, padded to ``GROUPS_PAD``), into
    ``(q [R, HEAD_DIM_PAD] in the storage dtype, scales [R, GROUPS_PAD] fp32)``. ``QMAX`` is the
    storage dtype's largest magnitude (127 or 448).
    """
    offs_d = tl.arange(0, x.shape[1])
    offs_g = tl.arange(0, GROUPS_PAD)
    gid = tl.where(d_valid, offs_d // QGROUP, GROUPS_PAD)  # [HEAD_DIM_PAD]; padding is in no group
    ax = tl.where(d_valid[None, :], tl.abs(x), 0.0)
    scales = tl.zeros([x.shape[0], GROUPS_PAD], dtype=tl.float32)
    per_element = tl.zeros_like(ax)  # each element's scale
    for g in tl.static_range(GROUPS):
        in_group = (gid == g)[None, :]
        scale = tl.math.div_rn(tl.max(tl.where(in_group, ax, 0.0), 1), QMAX)[:, None]  # [R, 1]
        scales = tl.where((offs_g == g)[None, :], scale, scales)
        per_element = tl.where(in_group, scale, per_element)
    positive = per_element > 0
    ones = tl.full(ax.shape, 1.0, tl.float32)
    inv = tl.where(positive, tl.math.div_rn(ones, tl.where(positive, per_element, 1.0)), 0.0)
    y = x * inv
    if QUANT == 1:
        q = tl.minimum(tl.maximum(round_even(y), -QMAX), QMAX).to(tl.int8)
    else:
        q = round_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX)).to(tl.float8e4nv)
        # the H100's conversion drops the sign of a zero, which torch's keeps: y's sign bit goes back
        sign = ((y.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        q = (q.to(tl.uint8, bitcast=True) | sign).to(tl.float8e4nv, bitcast=True)
    return q, scales

