"""A kernel case over a quantized cache, and the check every implementation of the op is held to:
within the golden tolerance of the float64 attention over the dequantized cache, storing the
reference's bytes and scales."""

from __future__ import annotations

import torch

from kvgraph.cache.quant import dequantize, quantize
from kvgraph.ops import reference
from kvgraph.ops.reference import naive_attention_fp64


class QuantizedCase:
    """A ``KVCase`` with its cache quantized: ``kv_blocks`` 8-bit, ``kv_scales`` beside them, and the
    golden's histories and new K/V replaced by what the cache holds (dequantized)."""

    def __init__(self, case, storage: torch.dtype, group: int) -> None:
        self.case = case
        self.group = group
        blocks, self.kv_scales = quantize(case.kv_blocks, storage, group)
        self.kv_blocks = blocks

        def held(x: torch.Tensor) -> torch.Tensor:
            return dequantize(*quantize(x, storage, group), torch.float64)

        self.k_cached = [held(k) for k in case.k_cached]
        self.v_cached = [held(v) for v in case.v_cached]
        self.k_new, self.v_new = held(case.k), held(case.v)

    def args(self) -> tuple:
        """The op's arguments (a fresh copy of the cache) with ``scale``, ``sliding_window``, ``softcap`` unset."""
        return (*self.case.args()[:3], self.kv_blocks.clone(), *self.case.args()[4:])

    def run(self, fn, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(out, blocks, scales)`` of ``fn`` on a copy of the cache."""
        args, scales = self.args(), self.kv_scales.clone()
        return fn(*args, **kwargs, kv_scales=scales), args[3], scales

    def golden(self, **kwargs) -> torch.Tensor:
        c = self.case
        return naive_attention_fp64(c.q, self.k_new, self.v_new, self.k_cached, self.v_cached,
                                    c.input_row_offsets, **kwargs)


def check(impl, qcase: QuantizedCase, check_against_golden, **kwargs) -> None:
    """``impl``'s output against the golden (``check_against_golden``), its stored bytes and scales
    against the reference's."""
    out, blocks, scales = qcase.run(impl, **kwargs)
    ref, ref_blocks, ref_scales = qcase.run(reference.ragged_attention, **kwargs)
    assert out.dtype == qcase.case.q.dtype
    check_against_golden(out, qcase.golden(**kwargs), ref)
    assert torch.equal(blocks.view(torch.uint8), ref_blocks.view(torch.uint8))  # the same bytes stored
    assert torch.equal(scales, ref_scales)
