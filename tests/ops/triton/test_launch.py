"""The launch helpers' choices: fp32 dots on tensor cores at fp32's accuracy where Triton has it."""

import torch

from kvgraph.ops.triton.launch import FP32_DOT_PRECISION, dot_precision


def test_fp32_dots_take_three_tf32_products_except_on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert FP32_DOT_PRECISION == "tf32x3"
    assert dot_precision(torch.float32) == "tf32x3"
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"  # exact in any
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm's Triton has no tf32x3
    assert dot_precision(torch.float32) == "ieee"
