"""The Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, with the ``ptxas``
that Triton's wheel bundles (``sm90_compile.py``, in a process without the interpreter). Triton's
interpreter runs kernels as Python and accepts code the compiler refuses (a plain global read in a
jitted function is one), so this checks what otherwise only a GPU run would.

It also checks what the quantized store's exactness rests on in the generated PTX: IEEE division,
no fused multiply-add, and the round-to-even constant's add kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("sm90_compile.py")
CASES = ["store-float", "store-int8", "store-fp8", "decode-fp32", "decode-bf16", "decode-bf16-int8",
         "decode-fp16-fp8", "decode-fp32-int8", "decode-fp32-int8-row", "decode-fp32-fp8-row", "prefill-bf16",
         "prefill-bf16-int8", "prefill-fp16-fp8", "prefill-fp32", "prefill-fp32-int8-row"]

pytestmark = pytest.mark.skipif("nvidia" not in triton.backends.backends,
                                reason="this Triton has no NVIDIA backend to compile with")


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("case", CASES)
def test_kernel_compiles_for_sm90(report, case):
    assert "error" not in report[case], report[case].get("error")
    assert report[case]["cubin_bytes"] > 0


@pytest.mark.parametrize("case", ["store-int8", "store-fp8"])
def test_quantized_store_divides_exactly_and_fuses_no_rounding(report, case):
    ptx = report[case]
    assert "error" not in ptx, ptx.get("error")
    assert ptx["div_rn"] and not ptx["div_approx"] and not ptx["fma"]
    if case == "store-int8":
        assert ptx["rounder"]  # 1.5 * 2**23 added, not folded away
