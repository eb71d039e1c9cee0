"""The launch helpers' choices: fp32 dots on tensor cores at fp32's accuracy where Triton has it."""

import pytest
import torch

import kvgraph.ops.triton.launch as launch
from kvgraph.ops.triton.launch import (
    FP32_DOT_PRECISION,
    FP32_SPLIT_PARTS,
    dot_constexprs,
    dot_precision,
)


def test_fp32_dots_take_three_tf32_products_except_on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert FP32_DOT_PRECISION == "tf32x3"
    assert dot_precision(torch.float32) == "tf32x3"
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"  # exact in any
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm's Triton has no tf32x3
    assert dot_precision(torch.float32) == "ieee"


class _Cache:
    """What ``dot_constexprs`` reads of a ``PagedLayer``: its quantization constants."""

    def __init__(self, quant: int, groups: int) -> None:
        self.quant, self.groups = quant, groups

    def quant_constexprs(self) -> dict:
        return {"QUANT": self.quant, "GROUPS": self.groups}


@pytest.mark.parametrize(
    "q_dtype, quant, groups, split",
    [
        (torch.float32, 1, 1, FP32_SPLIT_PARTS),  # int8, one scale per row: split bf16 dots
        (torch.float32, 2, 1, FP32_SPLIT_PARTS),  # float8 likewise
        (torch.float32, 1, 2, 0),  # two scales per row: the tile is dequantized to fp32 first
        (torch.float32, 0, 1, 0),  # a float cache
        (torch.bfloat16, 1, 1, 0),  # 16-bit queries: one bf16 dot is exact already
    ],
)
def test_split_dots_only_for_fp32_queries_over_an_8_bit_cache_with_row_scales(monkeypatch, q_dtype, quant,
                                                                               groups, split):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    assert dot_constexprs(q_dtype, _Cache(quant, groups)) == {"DOT_PRECISION": dot_precision(q_dtype), "SPLIT": split}
    monkeypatch.setattr(launch, "interpreting", lambda: True)  # no bf16 tl.dot in the interpreter
    assert dot_constexprs(q_dtype, _Cache(quant, groups))["SPLIT"] == 0
